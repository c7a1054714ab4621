"""Attention over the slot cache whose result for a sequence never depends on its batch.

Continuous batching decides, by arrival timing, which sequences share a forward. A
single attention call over the whole batch reads every row's keys up to the batch's
longest sequence (decode), or pads every prompt chunk to the widest one (prefill),
and PyTorch's CPU attention rounds differently for different key and query lengths:
the same request's log-probs then moved by ~1e-6 with its neighbours. That alone
broke the promise that a synchronous run with a fixed seed repeats exactly: the
trainer's loss reads those log-probs, Adam turns float noise in near-zero gradients
into weight differences of up to ~lr, and a few steps later the sampled tokens differ.

So every attention call's shapes depend on one sequence alone:

- decode: where the C kernel is built (native_attention.py), each row reads exactly its
  own keys, one thread per (row, head), whatever the batch and the thread count. Else a
  row reads its keys up to its own length rounded up to `KEY_BLOCK`; rows of the same
  rounded length share one call (one call when the batch's lengths are close, as a GRPO
  batch's are). In float32 that call is two batched matmuls and a softmax rather than
  the fused kernel, which costs more per (row, head) than those few-row products do;
- prefill: a row's chunk attends in pieces cut at multiples of `QUERY_BLOCK` (absolute
  positions), each over exactly the keys up to its last query, read from the row's
  slot in place. A piece is the same computation whether the prompt came alone, padded
  next to a longer one, or started after a prefix-cache hit (the cache's blocks are
  query blocks), so its keys and values are the same too. Pieces of one shape, from
  chunks started alike, share one call.

Rows of one call never mix: with one thread the kernel computes each (row, head)
alone, so who else is in the call does not change a row's numbers; the linear layers
around attention are row-wise too, once one or two rows are padded to more
(runner.py, `MIN_LINEAR_ROWS`). tests/unit/test_batch_invariance.py checks all of it.
With `engine.num_threads` above 1, PyTorch's CPU attention splits its work by batch
size and the last bits still move: a bit-exact repeat needs one engine thread. Measured
on SmolLM2-135M (fp32, one thread, 2 shared cores): no slower than one call per batch,
within run-to-run noise, on decode and on prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from asyncgrpo.inference.engine import native_attention

KEY_BLOCK = 64  # decode key lengths are rounded up to a multiple of this
QUERY_BLOCK = 16  # prefill queries attend in blocks of this many positions (aligned)


def decode_key_length(length: int, max_model_len: int) -> int:
    """The key length a decoding row of `length` cached positions attends over."""
    return min(-(-length // KEY_BLOCK) * KEY_BLOCK, max_model_len)


@dataclass
class DecodeSpan:
    """The decode rows that attend over `key_len` keys, computed as the slot range lo..hi-1.

    `members`: their indices within the range, None when the range is exactly them
    (rows in the range but not members are computed too and thrown away).
    """

    lo: int
    hi: int
    key_len: int
    members: torch.Tensor | None
    mask: torch.Tensor  # (hi - lo, 1, 1, key_len): a row sees its own positions 0..pos


def decode_spans(positions: torch.Tensor, max_model_len: int) -> list[DecodeSpan]:
    """Group decode rows (slots 0..B-1 at `positions`, (B,)) by their key length."""
    lengths = [decode_key_length(p + 1, max_model_len) for p in positions.tolist()]
    spans = []
    for key_len in sorted(set(lengths)):
        rows = [r for r, x in enumerate(lengths) if x == key_len]
        lo, hi = rows[0], rows[-1] + 1
        members = None if len(rows) == hi - lo else torch.tensor(rows) - lo
        mask = torch.arange(key_len) <= positions[lo:hi].unsqueeze(1)
        spans.append(DecodeSpan(lo, hi, key_len, members, mask.view(hi - lo, 1, 1, key_len)))
    return spans


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    spans: list[DecodeSpan],
    lengths: torch.Tensor,
) -> torch.Tensor:
    """q: (B, kv_heads, group, D), the query heads of a kv head folded into the query
    length; caches (slots, kv_heads, capacity, D); `lengths` (B,) int64: the keys row b
    sees (its position + 1). Returns (B, kv_heads, group, D).

    The C kernel (native_attention.py) where it is built: each row over exactly its own
    keys; else PyTorch's, one call per span."""
    if native_attention.usable(q, k_cache, v_cache):
        return native_attention.decode_attention(q, k_cache, v_cache, lengths)
    if len(spans) == 1 and spans[0].members is None:
        s = spans[0]
        return _attend(q, k_cache, v_cache, s)
    out = torch.empty_like(q)
    for s in spans:
        result = _attend(q[s.lo : s.hi], k_cache, v_cache, s)
        if s.members is None:
            out[s.lo : s.hi] = result
        else:
            out[s.members + s.lo] = result[s.members]
    return out


def _attend(q, k_cache, v_cache, s: DecodeSpan) -> torch.Tensor:
    keys = k_cache[s.lo : s.hi, :, : s.key_len]
    values = v_cache[s.lo : s.hi, :, : s.key_len]
    if q.dtype != torch.float32:  # its kernel accumulates in float32; bf16 scores would not
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=s.mask)
    # a decode query block is a few rows (the query heads of one kv head) against <= a few
    # hundred keys: two batched matmuls beat the CPU flash kernel's per-(row, head) setup
    # (a SmolLM2 decode step at batch 32, paired: 1.07x at 2 threads, level at one)
    scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)
    scores.masked_fill_(~s.mask, float("-inf"))  # a row always sees its own position
    return torch.matmul(scores.softmax(dim=-1), values)


@dataclass
class PrefillPiece:
    """Queries `q_lo..q_hi-1` of prefill row `row` (one aligned query block, or its part
    inside the chunk), attending over its slot's first `key_len` positions."""

    row: int
    slot: int
    q_lo: int
    q_hi: int
    mask: torch.Tensor  # (1, 1, q_hi - q_lo, key_len): query t sees positions <= its own

    @property
    def key_len(self) -> int:
        return self.mask.shape[-1]


def prefill_pieces(slots: list[int], starts: list[int], ends: list[int]) -> list[PrefillPiece]:
    """Split each row's chunk `starts[r]..ends[r]-1` at multiples of `QUERY_BLOCK`
    (absolute positions); each piece attends over the keys up to its own last query."""
    pieces = []
    for r, (slot, start, end) in enumerate(zip(slots, starts, ends, strict=True)):
        lo = start
        while lo < end:
            hi = min(end, (lo // QUERY_BLOCK + 1) * QUERY_BLOCK)
            mask = torch.arange(hi) <= torch.arange(lo, hi).unsqueeze(1)  # (hi - lo, hi)
            pieces.append(
                PrefillPiece(r, slot, lo - start, hi - start, mask.view(1, 1, hi - lo, hi))
            )
            lo = hi
    return pieces


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pieces: list[PrefillPiece]
) -> torch.Tensor:
    """q: (R, heads, T, D), T the widest chunk; caches (slots, kv_heads, capacity, D).
    Returns (R, heads, T, D), zero at the padding queries past a row's chunk.

    Pieces of one shape (the same queries of their chunks over the same keys: prompts
    started alike) attend in one call, rows side by side, as decode rows do."""
    out = torch.zeros_like(q)
    shapes: dict[tuple[int, int, int], list[PrefillPiece]] = {}
    for p in pieces:  # key_len is the piece's absolute end: the three fix its mask too
        shapes.setdefault((p.q_lo, p.q_hi, p.key_len), []).append(p)
    for (q_lo, q_hi, key_len), same in shapes.items():
        rows = _index([p.row for p in same])
        slots = _index([p.slot for p in same])
        out[rows, :, q_lo:q_hi] = F.scaled_dot_product_attention(
            q[rows, :, q_lo:q_hi],
            k_cache[slots, :, :key_len],  # (rows, kv_heads, key_len, D)
            v_cache[slots, :, :key_len],
            attn_mask=same[0].mask,
            enable_gqa=True,
        )
    return out


def _index(values: list[int]) -> slice | torch.Tensor:
    """A slice where `values` are consecutive (a view, no copy), else an index tensor."""
    if values == list(range(values[0], values[0] + len(values))):
        return slice(values[0], values[0] + len(values))
    return torch.tensor(values)
