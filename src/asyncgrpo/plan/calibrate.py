"""Fit the planner's costs from a run directory: `config.yaml`, `metrics.jsonl`, `samples.jsonl`.

What each file gives:

- `metrics.jsonl` (train rows): `train_step_s` against the step's tokens
  (`train_tokens_per_s * train_step_s`) is a line, `train_base_s + tokens *
  train_per_token_s`; `weight_sync_s` and `engine_pause_s` are the sync's two parts;
  `gen_tokens_per_s / engine_busy_ratio` is what the engine generates per busy second.
- `samples.jsonl`: every completion's `completion_tokens`, the empirical length law;
  the prompt's length is what the step's tokens leave over the completions.
- `config.yaml`: the layout the run had (`run_layout`).

One run has one batch size, so it cannot separate a decode step's fixed cost from its
per-sequence cost: the split is an assumption, `decode_batch_half` (the batch at which
the two are equal; 16 by default). The scale is then fitted by simulating the run's own
layout until its busy token rate matches the measured one. The first `skip` train rows
(start-up, first compilation) are left out.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from asyncgrpo.plan.costs import Costs, Lengths, PlanInputError
from asyncgrpo.plan.simulate import Deployment, Simulation


def _jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanInputError(f"cannot read {path}: {exc}") from None


# vLLM's own default for `--max-num-seqs`: what a vLLM engine batched unless `vllm_args` said
VLLM_MAX_NUM_SEQS = 256


def run_layout(run_dir: Path) -> Deployment:
    """The layout recorded in the run's `config.yaml`, read through the config models: a field
    the file leaves out takes the default the run had, not one of the planner's own."""
    from asyncgrpo.base.config import ConfigError, load_config

    try:
        cfg = load_config(run_dir / "config.yaml")
    except ConfigError as exc:
        raise PlanInputError(str(exc)) from None
    coord, engine = cfg.coordinator, cfg.engine
    return Deployment(
        engines=engine.replica_count,
        trainer_ranks=cfg.trainer.num_processes,
        max_staleness=coord.max_staleness,
        max_ahead_batches=coord.max_ahead_batches,
        batch_groups=coord.batch_groups,
        num_generations=cfg.rollout.num_generations,
        sync_mode=coord.sync_mode,
        weight_sync_steps=coord.weight_sync_steps,
        max_num_seqs=getattr(engine, "max_num_seqs", None) or _vllm_max_num_seqs(engine),
        engine_threads=getattr(engine, "num_threads", None) or 1,
        trainer_threads=cfg.trainer.num_threads,
    )


def _vllm_max_num_seqs(engine) -> int:
    """`--max-num-seqs N` (or `=N`) from a vLLM engine's `vllm_args`, else vLLM's default."""
    args = list(getattr(engine, "vllm_args", []))
    for i, arg in enumerate(args):
        if arg.startswith("--max-num-seqs="):
            return int(arg.split("=", 1)[1])
        if arg == "--max-num-seqs" and i + 1 < len(args):
            return int(args[i + 1])
    return VLLM_MAX_NUM_SEQS


def _train_fit(rows: list[dict]) -> tuple[float, float]:
    steps = np.array([r["train_step_s"] for r in rows], dtype=float)
    tokens = np.array([r["train_tokens_per_s"] * r["train_step_s"] for r in rows], dtype=float)
    if len(rows) >= 3 and np.ptp(tokens) > 0.05 * tokens.mean():
        per_token, base = np.polyfit(tokens, steps, 1)
        if per_token > 0 and base >= 0:
            return float(base), float(per_token)
    return 0.0, float(steps.sum() / tokens.sum())


def _busy_token_rate(rows: list[dict]) -> float:
    times = [0.0] + [float(r["time_s"]) for r in rows]
    made = busy = 0.0
    for r, dt in zip(rows, np.diff(times), strict=True):
        ratio = r.get("engine_busy_ratio")
        if ratio is None or r.get("gen_tokens_per_s") is None:
            continue
        made += r["gen_tokens_per_s"] * dt
        busy += ratio * dt
    if made <= 0 or busy <= 0:
        raise PlanInputError("metrics.jsonl has no engine_busy_ratio to fit decoding from")
    return made / busy


def fit_lengths(run_dir: Path, rows: list[dict]) -> Lengths:
    groups = _jsonl(run_dir / "samples.jsonl")
    lengths = [s["completion_tokens"] for g in groups for s in g.get("samples", [])]
    if not lengths:
        raise PlanInputError(f"{run_dir / 'samples.jsonl'} holds no completions")
    per_step = [r["train_tokens_per_s"] * r["train_step_s"] for r in rows]
    samples = len(lengths) / max(len(groups), 1)  # completions per group
    by_step: dict[int, int] = {}
    for g in groups:
        by_step[g["step"]] = by_step.get(g["step"], 0) + 1
    batch = np.mean(list(by_step.values())) * samples
    prompt = (np.mean(per_step) - batch * np.mean(lengths)) / batch
    return Lengths(tuple(int(n) for n in lengths), max(1, round(prompt)))


def calibrate(run_dir: Path, *, decode_batch_half: float = 16.0, skip: int = 1):
    """(costs, lengths, layout) fitted from the run in `run_dir`."""
    run_dir = Path(run_dir)
    rows = [r for r in _jsonl(run_dir / "metrics.jsonl") if r.get("kind", "train") == "train"]
    rows = rows[skip:] if len(rows) > skip + 1 else rows
    need = ("train_step_s", "train_tokens_per_s", "time_s")
    if not rows or any(k not in rows[0] for k in need):
        raise PlanInputError(f"{run_dir / 'metrics.jsonl'}: no train rows with {need}")
    layout = run_layout(run_dir)
    lengths = fit_lengths(run_dir, rows)
    base, per_token = _train_fit(rows)
    pause = float(np.median([r.get("engine_pause_s") or 0.0 for r in rows]))
    sync = float(np.median([r.get("weight_sync_s") or 0.0 for r in rows]))
    costs = Costs(
        decode_base_s=decode_batch_half * 1e-3,
        decode_per_seq_s=1e-3,
        prefill_per_token_s=1e-4,
        train_base_s=base,
        train_per_token_s=per_token,
        sync_transfer_s=max(0.0, sync - pause),
        pause_s=pause,
    )
    return _fit_decode(costs, lengths, layout, _busy_token_rate(rows)), lengths, layout


def _fit_decode(costs: Costs, lengths: Lengths, layout: Deployment, rate: float) -> Costs:
    """Scale the engine's costs until the simulated run generates `rate` tokens per busy s."""
    for _ in range(4):  # a fixed point: the rate is inversely proportional to the scale
        sim = Simulation(layout, costs, lengths, seed=0)
        sim.run(12)
        busy = sum(b - a for e in sim.engines for a, b in e.busy)
        made = sum(e.generated for e in sim.engines)
        scale = float((made / busy) / rate)
        costs = replace(
            costs,
            decode_base_s=costs.decode_base_s * scale,
            decode_per_seq_s=costs.decode_per_seq_s * scale,
            prefill_per_token_s=costs.prefill_per_token_s * scale,
        )
    return costs
