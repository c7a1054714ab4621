"""Packed attention in one flash-attention call per layer on a GPU (`trainer.attention: varlen`).

On a GPU the other two layouts of `packing.py` both lose: one sdpa call per segment is
bound by kernel launches, and one call over the packed row with a dense block mask
computes all N² scores. Measured on an H100 with Qwen2.5-0.5B's shape and 16,384-token
micro-batches, the masked attention's forward and backward took 63% of the step's GPU
time (`benchmarks/trainer_speed.py --profile`, `benchmarks/results/trainer_speed/`). Flash
attention's variable-length kernel (`torch.nn.attention.varlen`) attends within each
sequence of a concatenation in one launch, so the work is Σ Lᵢ².

A completion behind a shared prompt attends to that prompt, which lies elsewhere in the
row (and the prompt, in turn, to a beginning it shares with other prompts:
`prompt_tree.py`). Here each such segment is gathered as [its prefixes' rows, outermost
first, then its own rows] into one varlen sequence: every sequence is then plain causal
and square (where the kernel's causal alignment is unambiguous), and the segment's
outputs are the tail of its sequence. The prompt's own rows come from the prompt's
segment; the copies gathered in front of each completion compute P² extra scores each
and are discarded.

`trainer.attention: auto` picks it on a GPU under autocast. Measured on an H100
(`benchmarks/trainer_speed.py`, Qwen2.5-0.5B's shape, 16,384-token micro-batches, one
call): a step took 1.15 s against the dense mask's 2.49 s; the attention alone
(`benchmarks/attention_probe.py`) 1.8 ms forward + backward per layer against the
per-segment sdpa's 99 ms.

The kernel takes fp16 or bf16 only. Under autocast the queries arrive in float32 (RoPE)
and are cast to the autocast dtype, as sdpa would; fp32 activations without autocast go
to the per-segment sdpa path instead (`varlen_dtype`). Older torch releases name
causality `is_causal` and take neither `scale` nor grouped KV heads; `_varlen_call`
adapts.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asyncgrpo.learning.trainer.segments import ancestry

HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class VarlenLayout:
    gather: torch.Tensor  # (T,) packed rows, varlen sequence after sequence
    cu_seqlens: torch.Tensor  # (S+1,) int32 offsets of the sequences in `gather`
    max_len: int
    scatter: torch.Tensor  # (N,) for each packed row, the gathered row holding its output


def varlen_available() -> bool:
    """Whether this torch has the variable-length flash kernel and sees a GPU."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def varlen_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The half dtype the varlen kernel runs `query`'s attention in, or None (float32
    attention outside autocast, which the kernel cannot take).

    Under autocast the queries reach attention in float32 (RoPE multiplies the bf16
    projections by float32 cos/sin) while sdpa would attend in the autocast dtype, so the
    varlen path casts to it as sdpa does. Checking the queries' own dtype instead sent
    every autocast step to the per-segment path (measured 2.8x slower than `mask` on an H100)."""
    if query.dtype in HALF_DTYPES:
        return query.dtype
    device = query.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in HALF_DTYPES:
        return torch.get_autocast_dtype(device)
    return None


def varlen_layout(segments: Sequence, device: torch.device) -> VarlenLayout:
    """The gather and scatter indices of `segments` (`packing.Segment`, contiguous and in
    order): one varlen sequence per segment, the rows of the prompt it continues in front."""
    gather: list[int] = []
    scatter: list[int] = []
    offsets = [0]
    for seg, chain in zip(segments, ancestry(segments), strict=True):
        for a in chain:
            gather.extend(range(segments[a].start, segments[a].end))
        scatter.extend(range(len(gather), len(gather) + seg.end - seg.start))
        gather.extend(range(seg.start, seg.end))
        offsets.append(len(gather))
    lengths = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return VarlenLayout(
        gather=tensor(gather, torch.long),
        cu_seqlens=tensor(offsets, torch.int32),
        max_len=max(lengths),
        scatter=tensor(scatter, torch.long),
    )


def varlen_attention(
    query: torch.Tensor,  # (1, Hq, N, D)
    key: torch.Tensor,  # (1, Hkv, N, D)
    value: torch.Tensor,  # (1, Hkv, N, D)
    layout: VarlenLayout,
    scaling: float | None,
) -> torch.Tensor:
    """(1, N, Hq, D): causal attention within each of `layout`'s sequences."""
    q, k, v = (t[0].transpose(0, 1).index_select(0, layout.gather) for t in (query, key, value))
    out = _varlen_call(q, k, v, layout.cu_seqlens, layout.max_len, scaling)  # (T, Hq, D)
    return out.index_select(0, layout.scatter)[None]


def _varlen_call(q, k, v, cu_seqlens, max_len: int, scaling: float | None) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    params = _parameters(varlen_attn)
    options = {}
    if "window_size" in params:
        options["window_size"] = (-1, 0)  # causal
    else:
        options["is_causal"] = True
    if scaling is not None:
        if "scale" in params:
            options["scale"] = scaling
        else:  # the kernel's default is 1/sqrt(D): scale the queries to make up the rest
            q = q * (scaling * q.shape[-1] ** 0.5)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            options["enable_gqa"] = True
        else:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **options)


@functools.cache
def _parameters(fn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)
