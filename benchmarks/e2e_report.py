"""What `end_to_end.py` reads back from its finished runs, and how it reports them.

The benchmark script runs the systems and scores their snapshots; this module holds the
arithmetic over the results (throughput, the interpolated time to the threshold, the
paired async − sync difference, the per-seed target ratios) and the tables it prints,
so that running and reporting can be read apart. It is imported by plain name: a script
run as `python benchmarks/end_to_end.py` has `benchmarks/` on `sys.path`.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

ASYNC, SYNC, TRL = (
    "asyncgrpo async (staleness 2)",
    "asyncgrpo sync (staleness 0)",
    "TRL GRPOTrainer",
)
VLLM = "asyncgrpo async, vLLM engine"
SYSTEM_LABELS = {"async": ASYNC, "sync": SYNC, "trl": TRL, "vllm": VLLM}


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    train, evals = [], []
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            (evals if row.get("kind") == "eval" else train).append(row)
    return train, evals


def summarise(
    label: str, run_dir: Path, samples_per_step: int, curve: list, threshold: float | None
) -> dict:
    """Throughput from the run's metrics, learning from its scored curve [(time_s, reward)]."""
    train, _ = read_metrics(run_dir)
    steps = train[-1]["step"] if train else 0
    seconds = train[-1]["time_s"] if train else float("nan")
    reached = crossing_time(curve, threshold)
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
        "weight_sync_s_median": _median(train, "weight_sync_s"),
        "engine_pause_s_median": _median(train, "engine_pause_s"),
        "initial_reward": curve[0][1] if curve else None,
        "final_reward": curve[-1][1] if curve else None,
        "best_reward": max(r for _, r in curve) if curve else None,
        "time_to_threshold_s": reached,
        "curve": curve,
        "run_dir": str(run_dir),
    }


def _median(rows: list[dict], key: str) -> float | None:
    values = [row[key] for row in rows if row.get(key)]
    return statistics.median(values) if values else None


def crossing_time(curve: list, threshold: float | None) -> float | None:
    """When the curve [(time_s, reward)] first reaches `threshold`, interpolated linearly
    between the two scored snapshots around the crossing, so that a system with fewer
    (slower) steps is not charged up to a whole snapshot interval for its coarser curve."""
    if threshold is None:
        return None
    for i, (t, r) in enumerate(curve):
        if r >= threshold:
            if i == 0:
                return t
            t0, r0 = curve[i - 1]
            return t0 + (threshold - r0) / (r - r0) * (t - t0)
    return None


def snapshots(run_dir: Path) -> list[tuple[int, float, Path]]:
    """(step, training time, weights) of every snapshot a run saved, its final weights last."""
    train, _ = read_metrics(run_dir)
    time_at_step = {row["step"]: float(row["time_s"]) for row in train}
    found = [
        (int(path.stem.split("-")[1]), path)
        for path in sorted((run_dir / "weights").glob("step-*.safetensors"))
    ]
    last = train[-1]["step"] if train else 0
    final = run_dir / "final_model.safetensors"  # TRL's
    if not final.exists():
        from asyncgrpo.learning.trainer.checkpoint import latest_checkpoint

        ckpt = latest_checkpoint(run_dir / "checkpoints")
        final = ckpt / "model.safetensors" if ckpt else None
    if final is not None and last and (not found or found[-1][0] < last):
        found.append((last, final))
    return [(step, time_at_step[step], path) for step, path in found if step in time_at_step]


def paired_difference(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of a − b over the same prompts and its standard error."""
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    return statistics.mean(diffs), statistics.stdev(diffs) / len(diffs) ** 0.5


def midpoint_threshold(initial: list[float], curves: dict[str, list]) -> float | None:
    """The default threshold: halfway from the initial held-out reward to the best final one
    over the systems (None when no system has a scored snapshot)."""
    finals = [c[-1][1] for c in curves.values() if len(c) > 1]
    return (statistics.mean(initial) + max(finals)) / 2 if finals else None


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def print_seed(result: dict, args) -> None:
    print(
        f"\nrecipe {args.recipe}, seed {result['seed']}, budget {args.budget_s:.0f}s per system; "
        f"held-out reward: greedy on {result['scored_rows']} rows, scored after the runs; "
        f"threshold {fmt(result['threshold'])}"
    )
    header = (
        f"{'system':32} {'steps':>6} {'samples/s':>10} {'compl tok/s':>12} {'initial':>8} "
        f"{'final':>7} {'best':>7} {'t→thr (s)':>10} {'sync (s)':>9} {'pause (s)':>9}"
    )
    print(header + "\n" + "-" * len(header))
    for r in result["systems"]:
        print(
            f"{r['system']:32} {r['steps']:>6} {fmt(r['samples_per_s'], '.2f'):>10} "
            f"{fmt(r['completion_tokens_per_s'], '.1f'):>12} {fmt(r['initial_reward']):>8} "
            f"{fmt(r['final_reward']):>7} {fmt(r['best_reward']):>7} "
            f"{fmt(r['time_to_threshold_s'], '.0f'):>10} "
            f"{fmt(r.get('weight_sync_s_median')):>9} {fmt(r.get('engine_pause_s_median')):>9}"
        )
    if "async_minus_sync" in result:
        mean, se = result["async_minus_sync"]
        print(f"final reward, async − sync (paired by prompt): {mean:+.3f} ± {se:.3f} (SE)")


def ratios(result: dict) -> dict[str, float | None]:
    """The benchmark's targets for one seed, as ratios (None when a side is missing)."""
    by = {r["system"]: r for r in result["systems"]}

    def ratio(key: str, a: str, b: str):
        if a in by and b in by and by[a][key] and by[b][key]:
            return by[a][key] / by[b][key]
        return None

    return {
        "async/TRL samples/s (≥ 2)": ratio("samples_per_s", ASYNC, TRL),
        "async/TRL time to threshold (≤ 0.5)": ratio("time_to_threshold_s", ASYNC, TRL),
        "async/sync samples/s (≥ 1.2)": ratio("samples_per_s", ASYNC, SYNC),
        "async − sync final reward": result.get("async_minus_sync", (None,))[0],
        "vLLM/TRL samples/s": ratio("samples_per_s", VLLM, TRL),
        "vLLM/embedded samples/s": ratio("samples_per_s", VLLM, ASYNC),
    }


def print_targets(seeds: list[int], per_seed: list[dict[str, float | None]]) -> None:
    """Each target's value per seed and its median over the seeds that have it."""
    print(f"\ntargets per seed {seeds} and their median:")
    for key in per_seed[0]:
        values = [p[key] for p in per_seed]
        known = [v for v in values if v is not None]
        median = statistics.median(known) if known else None
        cells = " ".join(f"{fmt(v, '+.3f' if '−' in key else '.2f'):>7}" for v in values)
        spec = "+.3f" if "−" in key else ".2f"
        print(f"  {key:38} {cells}   median {fmt(median, spec)}")
