"""Wall-clock learning, side by side: asyncgrpo async, asyncgrpo synchronous, TRL GRPOTrainer.

Every system trains the same model on the same recipe (task, rewards,
hyperparameters) for the same training wall-clock budget, one after the
other on the same machine. Held-out reward is measured the same way for all
(greedy completions of the recipe's eval rows) and, for TRL, outside its
clock. Reported per system: samples/s (completions trained per second) and
completion tokens/s (the same, weighted by the learned completion length),
time to reach the reward threshold, final held-out reward; plus one plot of
held-out reward vs wall-clock for all of them.

    python benchmarks/end_to_end.py --recipe recipes/default.yaml --budget-s 900
    python benchmarks/end_to_end.py --systems async,sync --budget-s 300   # skip TRL

The threshold defaults to the midpoint between the initial held-out reward
and the best final one over the systems (stated in the output).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    train, evals = [], []
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            (evals if row.get("kind") == "eval" else train).append(row)
    return train, evals


def eval_times(train: list[dict], evals: list[dict]) -> list[tuple[float, float]]:
    """(training time at which the evaluated weights existed, reward) per evaluation."""
    time_at_step = {row["step"]: row["time_s"] for row in train}
    time_at_step.setdefault(0, 0.0)
    points = []
    for row in evals:
        t = time_at_step.get(row["step"], row["time_s"])
        points.append((float(t), float(row["eval_reward_mean"])))
    return sorted(points)


def run_asyncgrpo(
    recipe: str, out: Path, name: str, staleness: int, budget: float, extra: list[str]
) -> Path:
    sets = [
        f"name={name}",
        f"output_dir={out}",
        f"max_time_s={budget}",
        "max_steps=100000",
        f"coordinator.max_staleness={staleness}",
        *extra,
    ]
    cmd = [sys.executable, "-m", "asyncgrpo.cli", "train", recipe]
    for s in sets:
        cmd += ["--set", s]
    log = out / f"{name}.log"
    print(f"[{name}] {' '.join(cmd)}  (log: {log})", flush=True)
    with log.open("w") as fh:
        subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, check=True, cwd=ROOT)
    return out / name


def run_trl(recipe: str, out: Path, budget: float, extra: list[str], threads: int) -> Path:
    run_dir = out / "trl"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "trl_baseline.py"),
        recipe,
        "--out",
        str(run_dir),
        "--budget-s",
        str(budget),
        "--threads",
        str(threads),
    ]
    for s in extra:
        cmd += ["--set", s]
    log = out / "trl.log"
    print(f"[trl] {' '.join(cmd)}  (log: {log})", flush=True)
    with log.open("w") as fh:
        subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, check=True, cwd=ROOT)
    return run_dir


def summarise(label: str, run_dir: Path, samples_per_step: int, threshold: float | None) -> dict:
    train, evals = read_metrics(run_dir)
    points = eval_times(train, evals)
    steps = train[-1]["step"] if train else 0
    seconds = train[-1]["time_s"] if train else float("nan")
    reached = next((t for t, r in points if threshold is not None and r >= threshold), None)
    # samples/s depends on how long the learned completions are; tokens/s does not
    completion_tokens = sum((row.get("completion_len_mean") or 0.0) for row in train)
    return {
        "system": label,
        "steps": steps,
        "train_seconds": seconds,
        "samples_per_s": steps * samples_per_step / seconds if train else float("nan"),
        "completion_tokens_per_s": completion_tokens * samples_per_step / seconds
        if train
        else float("nan"),
        "completion_len_mean": completion_tokens / len(train) if train else None,
        "initial_eval_reward": points[0][1] if points else None,
        "final_eval_reward": points[-1][1] if points else None,
        "best_eval_reward": max(r for _, r in points) if points else None,
        "time_to_threshold_s": reached,
        "eval_points": points,
        "run_dir": str(run_dir),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/default.yaml")
    parser.add_argument(
        "--budget-s", type=float, default=900.0, help="training wall-clock per system"
    )
    parser.add_argument("--systems", default="async,sync,trl")
    parser.add_argument("--threshold", type=float, default=None)
    parser.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL run")
    parser.add_argument("--out", default="benchmarks/results/end_to_end")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        help="recipe override applied to every system",
    )
    args = parser.parse_args(argv)

    from asyncgrpo.config import load_config

    cfg = load_config(args.recipe, args.overrides)
    samples_per_step = cfg.coordinator.batch_groups * cfg.rollout.num_generations
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    runs: dict[str, Path] = {}
    started = time.time()
    for system in systems:
        if system == "async":
            runs["asyncgrpo async (staleness 2)"] = run_asyncgrpo(
                args.recipe, out, "async", 2, args.budget_s, args.overrides
            )
        elif system == "sync":
            runs["asyncgrpo sync (staleness 0)"] = run_asyncgrpo(
                args.recipe, out, "sync", 0, args.budget_s, args.overrides
            )
        elif system == "trl":
            runs["TRL GRPOTrainer"] = run_trl(
                args.recipe, out, args.budget_s, args.overrides, args.trl_threads
            )
        else:
            parser.error(f"unknown system {system!r} (async, sync, trl)")

    threshold = args.threshold
    if threshold is None:
        first = [summarise(k, v, samples_per_step, None) for k, v in runs.items()]
        initial = [s["initial_eval_reward"] for s in first if s["initial_eval_reward"] is not None]
        final = [s["final_eval_reward"] for s in first if s["final_eval_reward"] is not None]
        if initial and final:
            threshold = (min(initial) + max(final)) / 2
    rows = [summarise(k, v, samples_per_step, threshold) for k, v in runs.items()]

    def fmt(x, spec=".3f"):
        return "-" if x is None else format(x, spec)

    print(
        f"\nrecipe {args.recipe}, budget {args.budget_s:.0f}s per system, "
        f"threshold {fmt(threshold)} (held-out reward)"
    )
    header = (
        f"{'system':32} {'steps':>6} {'samples/s':>10} {'compl tok/s':>12} {'eval@0':>7} "
        f"{'final':>7} {'best':>7} {'t→thr (s)':>10}"
    )
    print(header + "\n" + "-" * len(header))
    for r in rows:
        print(
            f"{r['system']:32} {r['steps']:>6} {fmt(r['samples_per_s'], '.2f'):>10} "
            f"{fmt(r['completion_tokens_per_s'], '.1f'):>12} "
            f"{fmt(r['initial_eval_reward']):>7} {fmt(r['final_eval_reward']):>7} "
            f"{fmt(r['best_eval_reward']):>7} {fmt(r['time_to_threshold_s'], '.0f'):>10}"
        )

    from asyncgrpo.metrics.plots import plot_compare

    png = plot_compare(
        {k: v for k, v in runs.items()},
        out / "end_to_end.png",
        title=f"held-out reward vs wall-clock ({Path(args.recipe).stem})",
    )
    result = {
        "recipe": args.recipe,
        "budget_s": args.budget_s,
        "threshold": threshold,
        "overrides": args.overrides,
        "total_s": time.time() - started,
        "systems": rows,
        "plot": str(png),
    }
    (out / "end_to_end.json").write_text(json.dumps(result, indent=1))
    print(f"\nplot: {png}\njson: {out / 'end_to_end.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
