"""Packed attention alone, forward + backward, in each layout the trainer can use: where a
training step's attention time goes, without the rest of the model around it.

`trainer_speed.py` measures whole steps; on an H100 the `varlen` step was 2.8x slower
than the dense-mask step, and whole-step profiles are too large to come back in a short
GPU call. This times one layer's attention on one packed micro-batch (the trainer's own
`pack_sequences` layout of GRPO-shaped groups) and splits the varlen path into its parts:

- `mask`: sdpa over the packed row with the dense block mask (`trainer.attention: mask`);
- `segments`: sdpa once per segment (`segments`);
- `varlen`: the trainer's varlen path (gather, one flash call, scatter);
- `varlen-kernel`: the flash call alone on pre-gathered contiguous tensors;
- `gather-scatter`: the index_selects alone (identity attention in between);
- `layout`: building the varlen indices on the host and copying them over.

    .venv/bin/python benchmarks/attention_probe.py --shape smollm2-135m --micro-batch-tokens 4096
    python benchmarks/attention_probe.py --device cuda --profile prof.txt    # one GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from ceiling import head_dim, synchronize  # benchmarks/ on sys.path
from result_files import SCRATCH, write_result
from trainer_speed import add_batch_arguments, make_groups, model_config

RESULTS = SCRATCH / "attention_probe.json"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_batch_arguments(ap, shape="qwen2.5-0.5b", micro_batch_tokens=16384, groups=32)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--profile", type=Path, help="write the varlen path's operator table here")
    ap.add_argument("--out", type=Path, default=RESULTS)
    return ap.parse_args(argv)


def packed_micro_batch(args, vocab: int, device: torch.device):
    """The first micro-batch the trainer would pack: whole groups while they fit."""
    from asyncgrpo.learning.trainer.packing import pack_sequences

    seqs, prompt_lengths, used = [], [], 0
    for group in make_groups(args, vocab, 0):
        size = len(group.rollouts[0].prompt_ids) + sum(
            len(r.completion_ids) for r in group.rollouts
        )
        if seqs and used + size > args.micro_batch_tokens:
            break
        used += size
        for r in group.rollouts:
            seqs.append(r.prompt_ids + r.completion_ids)
            prompt_lengths.append(len(r.prompt_ids))
    return pack_sequences(seqs, prompt_lengths, device=device)


def variants(packed, cfg, device: torch.device) -> dict:
    """name -> fn(q, k, v) returning the (1, N, Hq, D)-shaped output of one attention."""
    from asyncgrpo.learning.trainer.segments import attend_segments, sdpa_kernels
    from asyncgrpo.learning.trainer.varlen import (
        _varlen_call,
        varlen_attention,
        varlen_available,
        varlen_layout,
    )

    scale = head_dim(cfg) ** -0.5
    mask = packed.block_mask()

    def dense(q, k, v):  # as transformers' sdpa calls it: KV heads repeated, no enable_gqa
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        with sdpa_kernels(device):
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale
            )
        return out.transpose(1, 2)

    def segments(q, k, v):
        with sdpa_kernels(device):
            return attend_segments(q, k, v, packed.segments, 0.0, scale).transpose(1, 2)

    found = {"mask": dense, "segments": segments}
    if not (device.type == "cuda" and varlen_available()):
        return found
    layout = varlen_layout(packed.segments, device)

    def varlen(q, k, v):
        return varlen_attention(q, k, v, layout, scale)

    def kernel(q, k, v):  # the gathers are outside the timed region's autograd
        return _varlen_call(q, k, v, layout.cu_seqlens, layout.max_len, scale)

    def gather_scatter(q, k, v):
        g = q[0].transpose(0, 1).index_select(0, layout.gather)
        return g.index_select(0, layout.scatter)[None]

    found.update(varlen=varlen, gather_scatter=gather_scatter)
    found["varlen-kernel"] = kernel
    found["flex"] = flex_variant(packed, scale, device)
    return found


def flex_variant(packed, scale: float, device: torch.device):
    """FlexAttention with the packed layout as a block mask: compiled, skips empty blocks."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n = packed.input_ids.shape[1]
    doc = torch.empty(n, dtype=torch.long)
    visible_prompt = torch.full((n,), -1, dtype=torch.long)
    for i, seg in enumerate(packed.segments):
        doc[seg.start : seg.end] = i
        if seg.prefix is not None:
            visible_prompt[seg.start : seg.end] = seg.prefix
    doc, visible_prompt = doc.to(device), visible_prompt.to(device)

    def mask_mod(b, h, q, kv):
        return ((doc[q] == doc[kv]) & (q >= kv)) | (visible_prompt[q] == doc[kv])

    built = {}

    def flex(q, k, v):  # built on first use, so that a failure is that variant's alone
        if not built:
            built["mask"] = create_block_mask(mask_mod, None, None, n, n, device=device)
            built["fn"] = torch.compile(flex_attention)
        gqa = q.shape[1] != k.shape[1]
        out = built["fn"](q, k, v, block_mask=built["mask"], scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2)

    return flex


def time_variant(fn, inputs, repeats: int, device: torch.device) -> dict[str, float]:
    """Median forward and forward+backward milliseconds."""
    fwd, both = [], []
    for i in range(repeats + 2):
        q, k, v = (t.detach().requires_grad_() for t in inputs)
        synchronize(device)
        start = time.perf_counter()
        out = fn(q, k, v)
        synchronize(device)
        mid = time.perf_counter()
        out.backward(torch.ones_like(out))
        synchronize(device)
        end = time.perf_counter()
        if i >= 2:  # warm-ups
            fwd.append((mid - start) * 1e3)
            both.append((end - start) * 1e3)
    return {"forward_ms": statistics.median(fwd), "forward_backward_ms": statistics.median(both)}


def inputs_for(name, packed, cfg, dtype, device: torch.device):
    n, d = packed.input_ids.shape[1], head_dim(cfg)
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    gen = torch.Generator(device="cpu").manual_seed(0)
    if name == "varlen-kernel":
        from asyncgrpo.learning.trainer.varlen import varlen_layout

        t = varlen_layout(packed.segments, device).gather.numel()
        shapes = [(t, hq, d), (t, hkv, d), (t, hkv, d)]
    else:
        shapes = [(1, hq, n, d), (1, hkv, n, d), (1, hkv, n, d)]
    return [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]


def measure(found: dict, packed, cfg, dtype, device: torch.device, repeats: int) -> dict:
    """Each variant's timings, and its output's distance from the mask's where it computes
    the same attention; a variant that fails is reported and skipped."""
    rows = {}
    reference = found["mask"](*inputs_for("mask", packed, cfg, dtype, device)).float()
    for name, fn in found.items():
        inputs = inputs_for(name, packed, cfg, dtype, device)
        try:
            row = time_variant(fn, inputs, repeats, device)
            if name in ("segments", "varlen", "flex"):  # the same attention as the mask's
                row["max_diff_vs_mask"] = (fn(*inputs).float() - reference).abs().max().item()
        except Exception as exc:  # noqa: BLE001 - a probe reports a failing variant, goes on
            print(f"  {name:15s} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        rows[name] = row
        diff = (
            f"   max |out - mask's| {row['max_diff_vs_mask']:.1e}"
            if "max_diff_vs_mask" in row
            else ""
        )
        print(
            f"  {name:15s} forward {row['forward_ms']:8.2f} ms   "
            f"forward+backward {row['forward_backward_ms']:8.2f} ms{diff}",
            flush=True,
        )
    return rows


def time_layout(packed, device: torch.device, repeats: int) -> float:
    from asyncgrpo.learning.trainer.varlen import varlen_layout

    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        varlen_layout(packed.segments, device)
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def write_profile(path: Path, fn, inputs, device: torch.device) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    q, k, v = (t.detach().requires_grad_() for t in inputs)
    with profile(activities=activities) as prof:
        out = fn(q, k, v)
        out.backward(torch.ones_like(out))
        synchronize(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    device_table = prof.key_averages().table(sort_by=key, row_limit=25)
    host_table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
    path.write_text(f"{device_table}\n\nBy host time:\n{host_table}")
    print(f"wrote {path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    cfg = model_config(args.shape)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    packed = packed_micro_batch(args, cfg.vocab_size, device)
    n = packed.input_ids.shape[1]
    work = sum((s.end - s.start) ** 2 for s in packed.segments)
    print(
        f"{args.shape}, {device}, {dtype}: packed row of {n} tokens, {len(packed.segments)} "
        f"segments, N² / Σ Lᵢ² = {n * n / work:.0f}"
    )
    found = variants(packed, cfg, device)
    rows = measure(found, packed, cfg, dtype, device, args.repeats)
    if device.type == "cuda":
        rows["layout"] = {"host_ms": time_layout(packed, device, args.repeats)}
        print(f"  layout          {rows['layout']['host_ms']:8.2f} ms on the host")
    if args.profile and "varlen" in rows:
        fn = variants(packed, cfg, device)["varlen"]
        write_profile(args.profile, fn, inputs_for("varlen", packed, cfg, dtype, device), device)
    record = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "packed_tokens": n,
        "segments": len(packed.segments),
        "torch": torch.__version__,
        "rows": rows,
    }
    if device.type == "cuda":
        record["device_name"] = torch.cuda.get_device_name()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")
    write_result("attention_probe", record, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
