"""Attention over the segments of a packed row, one sdpa call per segment.

`packing.py` lays many sequences out in one row; a `Segment` is a run of its rows that
attends causally to itself, and to a shared prompt's rows behind it. Where no varlen
kernel runs (a CPU; float32 activations), `attend_segments` calls sdpa once per
segment, so the work is the sum of the segments' squares, not the row's.
`merge_completions` first joins small completions behind one prompt into one call.

On a GPU the calls exclude cuDNN's attention: it plans each new shape on the CPU,
and packed rows and segments rarely repeat a shape (measured on an H100 with
SmolLM2-135M: ~2 ms of CPU per call, 2.5 s of a 16-sample step); flash and
memory-efficient attention launch in microseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# completions behind one prompt attend in one sdpa call while their rows total at most
# this (`merge_completions`): a call costs ~0.1 ms more than its arithmetic on a CPU
MERGED_ROWS = 128


@dataclass(frozen=True)
class Segment:
    """Rows [start, end) of the packed row: causal among themselves, plus full
    attention to every row of segment number `prefix` (a shared prompt or part of one),
    if set, and to that segment's own prefixes in turn (`ancestry`). With a prefix,
    `mask` says which (prefixes + own) keys each row attends to: a causal block for one
    completion, block-diagonal causal blocks for merged ones."""

    start: int
    end: int
    prefix: int | None = None
    mask: torch.Tensor | None = None  # (end-start, prefix length + end-start) bool, with a prefix


def ancestry(segments: Sequence[Segment]) -> list[tuple[int, ...]]:
    """Per segment, the segments it attends to in full, outermost first (a segment's
    prefix always comes before it in the row)."""
    chains: list[tuple[int, ...]] = []
    for seg in segments:
        chains.append(() if seg.prefix is None else (*chains[seg.prefix], seg.prefix))
    return chains


def prefix_causal_mask(length: int, prefix: int, device: torch.device) -> torch.Tensor:
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()  # (C, C)
    prompt = torch.ones(length, prefix, dtype=torch.bool, device=device)
    return torch.cat([prompt, causal], dim=1)


def merge_completions(
    segments: Sequence[Segment], max_rows: int = MERGED_ROWS
) -> tuple[Segment, ...]:
    """`segments` with consecutive completions behind the same prompt merged into one
    segment while their rows total at most `max_rows`, for the per-segment attention.

    The default recipe packs 8 completions of ~10 tokens behind each prompt: one call for
    them instead of 8 computes ~2x the scores it keeps (each row also scores its
    siblings' keys, masked), but the calls, not the arithmetic, are what cost there."""
    out: list[Segment] = []
    renumbered: dict[int, int] = {}  # a prefix's index in `segments` -> in `out`
    parents = {seg.prefix for seg in segments}
    run: list[Segment] = []

    def flush() -> None:
        if run:
            first, prefix = run[0], renumbered[run[0].prefix]
            one = Segment(first.start, first.end, prefix, first.mask)
            out.append(one if len(run) == 1 else _merged(run, prefix))
            run.clear()

    for i, seg in enumerate(segments):
        if seg.prefix is None or seg.mask is None or i in parents:
            flush()
            renumbered[i] = len(out)
            prefix = None if seg.prefix is None else renumbered[seg.prefix]
            out.append(Segment(seg.start, seg.end, prefix, seg.mask))
            continue
        # segments are contiguous: the run and this one span rows run[0].start .. seg.end
        if run and (run[0].prefix != seg.prefix or seg.end - run[0].start > max_rows):
            flush()
        run.append(seg)
    flush()
    return tuple(out)


def _merged(run: list[Segment], prefix: int) -> Segment:
    """One segment for contiguous completions behind prompt segment `prefix`, from their
    own masks: each row attends to the whole prompt and causally to its own completion
    only (the completions' causal blocks on the diagonal)."""
    prompt_length = run[0].mask.shape[1] - (run[0].end - run[0].start)
    prompt = torch.cat([s.mask[:, :prompt_length] for s in run])  # (R, P)
    own = torch.block_diag(*(s.mask[:, prompt_length:] for s in run))  # (R, R)
    return Segment(run[0].start, run[-1].end, prefix, torch.cat([prompt, own], dim=1))


def sdpa_kernels(device: torch.device):
    """sdpa's kernels for calls whose shapes rarely repeat (module docstring)."""
    if device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(
        [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    )


def attend_segments(query, key, value, packed_segments, dropout, scaling) -> torch.Tensor:
    """(1, Hq, N, D): sdpa over each segment, a completion's keys behind its prompt's.

    On a CPU the segments attend in float32 with autocast off: CPU autocast would cast
    sdpa's inputs to bf16, and torch's CPU flash kernel converts half inputs block by
    block; its backward on bf16 segments ran ~3x slower than on float32 ones
    (`docs/benchmarks/profiles.md`, the trainer on a CPU). The casts are N x D per head, small."""
    dtype = query.dtype
    if query.device.type != "cpu":
        return _sdpa_segments(query, key, value, packed_segments, dropout, scaling).to(dtype)
    with torch.autocast("cpu", enabled=False):
        query, key, value = query.float(), key.float(), value.float()
        out = _sdpa_segments(query, key, value, packed_segments, dropout, scaling)
    return out.to(dtype)


def _sdpa_segments(query, key, value, packed_segments, dropout, scaling) -> torch.Tensor:
    gqa = query.shape[1] != key.shape[1]
    # split, not slicing: the backward of S slices would zero-fill S full-size gradients
    sizes = [seg.end - seg.start for seg in packed_segments]
    queries, keys, values = (t.split(sizes, dim=2) for t in (query, key, value))
    outputs = []
    for i, (seg, chain) in enumerate(zip(packed_segments, ancestry(packed_segments), strict=True)):
        k, v = keys[i], values[i]
        if chain:
            k = torch.cat([*(keys[a] for a in chain), k], dim=2)
            v = torch.cat([*(values[a] for a in chain), v], dim=2)
        outputs.append(
            F.scaled_dot_product_attention(
                queries[i],
                k,
                v,
                attn_mask=seg.mask,
                dropout_p=dropout,
                is_causal=seg.mask is None,
                scale=scaling,
                enable_gqa=gqa,
            )
        )
    return torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
