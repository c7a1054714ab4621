"""Merge a LoRA adapter at each sync, or apply it as low-rank matmuls at each decode step?

The embedded engine can take an adapter sync two ways: merge it into its weights
(W = W_base + B @ A, paid once per sync) or keep the base weights and add
x @ A.T @ B.T to every targeted linear's output (paid at every decode step). This
measures both on SmolLM2-135M with the engine's own settings (weight dtype `auto`,
one thread):

- per sync: `Engine.update_weights` with a rank-r adapter on q/k/v/o (check, merge
  from the base copies, copy into the weights), plus the repacking of the touched
  linears that the next forward does; the first sync also takes the base copies;
- per decode step: a decode-shaped (batch, hidden) x @ A.T @ B.T and its add, for
  every targeted linear, times the layers; against the measured decode step.

    .venv/bin/python benchmarks/lora_apply.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import torch
from result_files import SCRATCH, write_result  # benchmarks/ is on sys.path

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.base.models import resolve_model
from asyncgrpo.inference.engine.engine import Engine

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def median_ms(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def random_adapter(engine: Engine, rank: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    """A rank-`rank` adapter on every q/k/v/o, under peft's saved names, in fp32."""
    generator = torch.Generator().manual_seed(seed)
    adapter = []
    for name, weight in engine.model.state_dict().items():
        if name.endswith(tuple(f"{t}.weight" for t in TARGETS)):
            out_features, in_features = weight.shape
            module = "base_model.model." + name.removesuffix(".weight")
            a = torch.randn(rank, in_features, generator=generator) * 0.01
            b = torch.randn(out_features, rank, generator=generator) * 0.01
            adapter += [(module + ".lora_A.weight", a), (module + ".lora_B.weight", b)]
    return adapter


def decode_step_ms(engine: Engine, batch: int, position: int, repeats: int) -> float:
    """One decode step of `batch` sequences at `position` (the runner's own forward)."""
    tokens = torch.randint(0, engine.vocab_size, (batch,))
    positions = torch.full((batch,), position)
    return median_ms(lambda: engine.runner.decode(tokens, positions), repeats)


def lowrank_step_ms(engine: Engine, batch: int, rank: int, repeats: int) -> float:
    """x @ A.T @ B.T + y for every targeted linear of one layer, times the layers."""
    dtype = engine.runner.dtype
    attn = engine.model.model.layers[0].self_attn
    shapes = [getattr(attn, t).weight.shape for t in TARGETS]  # (out, in)
    factors = [
        (
            torch.randn(batch, i, dtype=dtype),
            torch.randn(batch, o, dtype=dtype),
            torch.randn(rank, i, dtype=dtype),
            torch.randn(o, rank, dtype=dtype),
        )
        for o, i in shapes
    ]

    def one_layer():
        for x, y, a, b in factors:
            y + (x @ a.T) @ b.T  # (B, out)

    with torch.inference_mode():
        layer_ms = median_ms(one_layer, repeats * 4)
    return layer_ms * len(engine.model.model.layers)


async def sync_costs(engine: Engine, rank: int, syncs: int) -> dict:
    """Seconds of adapter syncs: the engine command, then the repack the next forward does."""
    engine.start()
    try:
        merge, repack = [], []
        for version in range(1, syncs + 1):
            adapter = random_adapter(engine, rank, seed=version)
            start = time.perf_counter()
            await engine.update_weights(adapter, version=version)
            merge.append(time.perf_counter() - start)
            start = time.perf_counter()
            await engine._run_on_engine(engine.runner._refresh)
            repack.append(time.perf_counter() - start)
    finally:
        engine.shutdown()
    first = 1000 * (merge[0] + repack[0])
    steady_merge = 1000 * statistics.median(merge[1:])
    steady_repack = 1000 * statistics.median(repack[1:])
    return {
        "first_sync_ms": round(first, 2),
        "merge_ms": round(steady_merge, 2),
        "repack_ms": round(steady_repack, 2),
        "sync_ms": round(steady_merge + steady_repack, 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model name or directory")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--position", type=int, default=128, help="decode position")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--syncs", type=int, default=6)
    parser.add_argument("--out", type=Path, default=SCRATCH / "lora_apply.json")
    args = parser.parse_args(argv)

    cfg = EmbeddedEngineConfig(model=str(resolve_model(args.model)), num_threads=1, max_num_seqs=64)
    engine = Engine(cfg)
    rows = []
    for batch in args.batches:
        step = decode_step_ms(engine, batch, args.position, args.repeats)
        lowrank = lowrank_step_ms(engine, batch, args.rank, args.repeats)
        rows.append(
            {"batch": batch, "decode_step_ms": round(step, 3), "lowrank_ms": round(lowrank, 3)}
        )
    sync = asyncio.run(sync_costs(engine, args.rank, args.syncs))
    for row in rows:
        row["lowrank_share"] = round(row["lowrank_ms"] / row["decode_step_ms"], 4)
        row["break_even_steps"] = round(sync["sync_ms"] / row["lowrank_ms"], 1)

    print(
        f"{args.model}, weights {cfg.resolved_dtype()}, compute {cfg.resolved_compute_dtype()}, "
        f"1 thread, r={args.rank} on {'/'.join(TARGETS)}, decode position {args.position}"
    )
    print(
        f"merge per sync: {sync['sync_ms']:.1f} ms (merge+copy {sync['merge_ms']:.1f}, "
        f"repack {sync['repack_ms']:.1f}; first sync with base copies {sync['first_sync_ms']:.1f})"
    )
    print(
        f"{'batch':>5} {'decode step ms':>15} {'low-rank ms':>12} {'share':>7} {'break-even':>11}"
    )
    for row in rows:
        print(
            f"{row['batch']:>5} {row['decode_step_ms']:>15.2f} {row['lowrank_ms']:>12.2f} "
            f"{row['lowrank_share']:>7.1%} {row['break_even_steps']:>8.1f} st"
        )
    result = {
        "model": args.model,
        "dtype": cfg.resolved_dtype(),
        "compute_dtype": cfg.resolved_compute_dtype(),
        "threads": 1,
        "rank": args.rank,
        "targets": list(TARGETS),
        "position": args.position,
        "sync": sync,
        "decode": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    write_result("lora_apply", result, argv)


if __name__ == "__main__":
    main()
