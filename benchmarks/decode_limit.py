"""The physical limit of a decode step, and the embedded engine's step against it.

A decode step at batch B reads every weight once and each row's keys and values, and
multiplies each weight with B rows: its time is at least max((weight bytes + KV bytes) /
copy bandwidth, FLOPs / matmul rate), with the bandwidth (a large device-to-device copy,
bytes read plus written) and the bf16 matmul rate measured on the same device. The
engine's step is timed on the runner an `Engine` builds (same layout, attention and
device), its slots prefilled with random tokens, then decode steps with the engine's
sampler between them, as the engine runs them: `step_ms` in all, `sample_ms` of it
sampling, synchronised on CUDA. Used by `gpu_engine.py`.
"""

from __future__ import annotations

import time

import torch
from ceiling import linear_weights, matmul_tflops, synchronize  # benchmarks/ is on sys.path


def copy_gb_s(device: torch.device, mib: int, repeats: int = 10) -> float:
    """Best device-to-device copy rate, bytes read plus bytes written."""
    src = torch.ones(mib * 2**20 // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for i in range(repeats + 3):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        if i >= 3:
            best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best / 1e9


def _prefill_rows(runner, rows: int, context: int, vocab: int, group_tokens: int) -> list[int]:
    """Slots 0..rows-1 prefilled with `context` random tokens each; their lengths."""
    gen = torch.Generator().manual_seed(0)
    per_call = max(1, group_tokens // context)
    for first in range(0, rows, per_call):
        slots = list(range(first, min(rows, first + per_call)))
        chunks = [torch.randint(vocab, (context,), generator=gen).tolist() for _ in slots]
        runner.prefill(slots, chunks, [0] * len(slots))
    return [context] * rows


def _time_decode(runner, batch: int, held: list[int], warmup: int, steps: int, vocab: int):
    """(ms per decode step, ms of it sampling, mean keys per row) over `steps` steps of
    slots 0..batch-1 after `warmup` untimed ones; `held` advances."""
    from asyncgrpo.inference.engine.sampling import RowParams, sample

    rows = [RowParams.sanitised(1.0, 1.0, 0, None, 0, vocab)] * batch
    tokens = torch.randint(vocab, (batch,))
    device, sampling, start, keys = runner.device, 0.0, 0.0, 0.0
    for step in range(warmup + steps):
        if step == warmup:
            synchronize(device)
            start, keys = time.perf_counter(), sum(held[:batch]) / batch + steps / 2
        logits = runner.decode(tokens, torch.tensor(held[:batch]))  # (B, V)
        held[:batch] = [n + 1 for n in held[:batch]]
        synchronize(device)
        drawn = time.perf_counter()
        tokens = torch.tensor(sample(logits, rows).tokens)
        sampling += (time.perf_counter() - drawn) if step >= warmup else 0.0
    total = time.perf_counter() - start
    return 1e3 * total / steps, 1e3 * sampling / steps, keys


def decode_bounds(config, batch: int, keys: float, weight_bytes: int, element: int) -> dict:
    """Bytes a decode step reads at least and the FLOPs it needs: every weight once, the
    batch's keys and values; 2 FLOPs per weight per row, 4 per (query head, key) pair and
    head dim."""
    head_dim = config.hidden_size // config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or head_dim
    per_key = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element
    body, head = linear_weights(config)
    attend = 4 * config.num_hidden_layers * config.num_attention_heads * head_dim * keys
    return {
        "batch": batch,
        "mean_keys": keys,
        "weight_bytes": weight_bytes,
        "kv_bytes": int(batch * keys * per_key),
        "flops": 2 * (body + head) * batch + attend * batch,
    }


def measure_limit(args, config, batches: list[int]) -> dict:
    """The device's copy and matmul rates, and per batch the engine's decode step against
    the limit they set; the engine built from `config`, never started (its runner is
    driven from here)."""
    from asyncgrpo.inference.engine.engine import Engine

    device = torch.device(args.device)
    rates = {"copy_gb_s": copy_gb_s(device, args.copy_mib)}
    rates["matmul_tflops"] = matmul_tflops(*[args.matmul_size] * 3, torch.bfloat16, device, 5)
    engine = Engine(config)
    torch.set_num_threads(args.threads)  # the engine leaves this thread at one
    runner, model = engine.runner, engine.model
    weight_bytes = sum(p.nbytes for p in {p.data_ptr(): p for p in model.parameters()}.values())
    element = next(model.parameters()).element_size()
    held = _prefill_rows(runner, max(batches), args.limit_context, engine.vocab_size, 8192)
    out = []
    for batch in batches:
        step_ms, sample_ms, keys = _time_decode(
            runner, batch, held, args.limit_warmup, args.limit_steps, engine.vocab_size
        )
        row = decode_bounds(model.config, batch, keys, weight_bytes, element)
        memory_ms = 1e3 * (row["weight_bytes"] + row["kv_bytes"]) / (rates["copy_gb_s"] * 1e9)
        compute_ms = 1e3 * row["flops"] / (rates["matmul_tflops"] * 1e12)
        row |= {"memory_ms": memory_ms, "compute_ms": compute_ms}
        row |= {"limit_ms": max(memory_ms, compute_ms), "step_ms": step_ms}
        row |= {"sample_ms": sample_ms, "forward_ms": step_ms - sample_ms}
        row["ratio"] = step_ms / row["limit_ms"]
        row["forward_ratio"] = row["forward_ms"] / row["limit_ms"]
        out.append(row)
    del engine, runner, model
    return rates | {"context": args.limit_context, "batches": out}
