"""Attention over the paged pools with FlexAttention: decode rows and packed prefill tokens.

FlexAttention takes one key sequence and a block mask that lists, per query tile, which
key tiles to visit. Here the key sequence is the whole pool of a layer, `(1, kv_heads,
slots, D)` (cache.py), the key tile is a cache block, and a row's list of tiles is its
block table: the block mask needs no translation, a row visits exactly its own blocks.
The `mask_mod` then decides single positions. A block's logical index is the same in
every sequence that holds it (blocks.py), so one `(num_blocks,)` table of logical
indices turns a physical position back into a logical one, and `table[row, logical] ==
block` tells whether the row holds the block at all. FlexAttention's eager path ignores
the block mask and applies `mask_mod` to every (query, pool position) pair, so the
mask_mod alone must be exact; the compiled kernel visits only the listed blocks, so
comparing the two checks the block mask too.

Why not torch's `torch.nn.attention.experimental._paged_attention.PagedAttention`,
which does the same on FlexAttention? It is private and marked experimental (it may
change between the torch releases an engine meets); its page allocator has no reference
counts, so pages cannot be shared between sequences, and sizes pages with `.item()`
host syncs; and it maps physical to logical pages with a `(max_batch, n_pages)` table,
rebuilt into the block mask by a gather every step. The idea kept from it: a mask_mod
that reads a physical-to-logical table, and the pool as one long key sequence.

Decode folds the query heads that share a key head into the query length, `(B, Hkv,
group, D)` against keys of `Hkv` heads: no GQA inside the kernel. Inductor's flex
decoding kernel takes GQA only when the group is a power of two (Qwen2.5-0.5B's is 7),
and with the heads folded it runs for any group. Prefill packs every sequence's new
tokens into one query row `(1, Hq, N, D)` (GQA in the kernel) after their keys and
values are written; a query tile may hold tokens of several sequences, so its tile
list is the union of their blocks and the mask_mod checks which sequence a query belongs to.

On a CPU, Inductor's flex kernel needs the block mask at least as wide as the pool
(`kernel_table_width`), and the block-mask tensors must be inputs of the compiled
graph, not computed inside it (torch 2.13's C++ code generation fails otherwise): the
metadata builders make them beforehand. The compiled path takes float32/bfloat16/float16 only; float64
runs eagerly (`compiled=False`), which is how the tests check the math exactly.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch

DEFAULT_QUERY_TILE = 128  # FlexAttention's default query block


def kernel_table_width(device_type: str, num_blocks: int, max_blocks_per_seq: int) -> int:
    """Columns of the block table the kernel is given: the whole pool on a CPU (see the
    module docstring); a sequence's most blocks elsewhere."""
    return num_blocks if device_type == "cpu" else max_blocks_per_seq


@dataclass
class PagedDecodeMetadata:
    """What decode attention reads besides the pools, for B rows (one new token each)."""

    block_tables: torch.Tensor  # (B, W) int32: each row's blocks, scratch-padded
    lengths: torch.Tensor  # (B,) int32: positions a row attends over, its new one included
    block_positions: torch.Tensor  # (num_blocks,) int32: logical index of each block
    kv_num_blocks: torch.Tensor  # (B, 1, 1) int32: blocks a row visits
    block_size: int

    @classmethod
    def build(
        cls,
        block_tables: torch.Tensor,
        lengths: torch.Tensor,
        block_positions: torch.Tensor,
        block_size: int,
    ) -> PagedDecodeMetadata:
        visits = (lengths + block_size - 1) // block_size
        return cls(
            block_tables,
            lengths,
            block_positions,
            visits.to(torch.int32).view(-1, 1, 1),
            block_size,
        )


@dataclass
class PagedPrefillMetadata:
    """What packed prefill attention reads: N query tokens of R sequences."""

    block_tables: torch.Tensor  # (R, W) int32
    query_rows: torch.Tensor  # (N,) int32: the sequence (table row) of each query
    query_positions: torch.Tensor  # (N,) int32: its absolute position
    block_positions: torch.Tensor  # (num_blocks,) int32
    kv_num_blocks: torch.Tensor  # (1, 1, tiles) int32: blocks each query tile visits
    kv_indices: torch.Tensor  # (1, 1, tiles, W) int32: which, in logical order per row
    block_size: int
    query_tile: int

    @classmethod
    def build(
        cls,
        block_tables: torch.Tensor,
        query_rows: torch.Tensor,
        query_positions: torch.Tensor,
        block_positions: torch.Tensor,
        block_size: int,
        query_tile: int = DEFAULT_QUERY_TILE,
    ) -> PagedPrefillMetadata:
        """The tile lists from the host copies: for each tile of `query_tile` queries,
        every block of its sequences up to the block of their last query there."""
        tables = block_tables.cpu().tolist()
        rows = query_rows.cpu().tolist()
        positions = query_positions.cpu().tolist()
        tiles = -(-len(rows) // query_tile)
        width = block_tables.shape[1]
        num = torch.zeros(1, 1, tiles, dtype=torch.int32)
        indices = torch.zeros(1, 1, tiles, width, dtype=torch.int32)
        for tile in range(tiles):
            last: dict[int, int] = {}  # row -> its last logical block in the tile
            for q in range(tile * query_tile, min(len(rows), (tile + 1) * query_tile)):
                last[rows[q]] = max(last.get(rows[q], 0), positions[q] // block_size)
            listed = [b for row, end in last.items() for b in tables[row][: end + 1]]
            listed = list(dict.fromkeys(listed))  # a shared prefix block once
            if len(listed) > width:
                raise ValueError(f"a query tile visits {len(listed)} blocks, width {width}")
            num[0, 0, tile] = len(listed)
            indices[0, 0, tile, : len(listed)] = torch.tensor(listed, dtype=torch.int32)
        device = block_tables.device
        return cls(
            block_tables,
            query_rows,
            query_positions,
            block_positions,
            num.to(device),
            indices.to(device),
            block_size,
            query_tile,
        )


def decode_attention(
    q: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    meta: PagedDecodeMetadata,
    scale: float | None = None,
    compiled: bool = True,
    kernel_options: dict | None = None,
    dynamic: bool | None = False,
) -> torch.Tensor:
    """q `(B, Hq, D)`, one new token per row; pools `(1, Hkv, slots, D)` with the new
    tokens already written. Returns `(B, Hq, D)`. `kernel_options`: FlexAttention's
    (tile sizes, warps), for tuning on a GPU. `dynamic`: torch.compile's (see `_compiled`)."""
    batch, heads, dim = q.shape
    kv_heads = key_pool.shape[1]
    folded = q.view(batch, kv_heads, heads // kv_heads, dim)  # (B, Hkv, group, D)
    kernel = _compiled(_decode_kernel, dynamic) if compiled else _eager(_decode_kernel)
    out = kernel(
        folded,
        key_pool,
        value_pool,
        meta.block_tables,
        meta.lengths,
        meta.block_positions,
        meta.kv_num_blocks,
        meta.block_tables.view(batch, 1, 1, -1),
        meta.block_size,
        scale,
        kernel_options,
    )
    return out.reshape(batch, heads, dim)


def prefill_attention(
    q: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    meta: PagedPrefillMetadata,
    scale: float | None = None,
    compiled: bool = True,
    kernel_options: dict | None = None,
    dynamic: bool | None = False,
) -> torch.Tensor:
    """q `(N, Hq, D)`, the packed new tokens of several sequences, each attending
    causally over its own earlier positions (cached prefix included); pools `(1, Hkv,
    slots, D)` with the new tokens already written. Returns `(N, Hq, D)`. On a GPU,
    a block smaller than the kernel's key tile needs `kernel_options={"BLOCK_N": ...}`
    no larger than the block (the tile must divide it)."""
    packed = q.transpose(0, 1).unsqueeze(0)  # (1, Hq, N, D)
    kernel = _compiled(_prefill_kernel, dynamic) if compiled else _eager(_prefill_kernel)
    out = kernel(
        packed,
        key_pool,
        value_pool,
        meta.block_tables,
        meta.query_rows,
        meta.query_positions,
        meta.block_positions,
        meta.kv_num_blocks,
        meta.kv_indices,
        meta.block_size,
        meta.query_tile,
        scale,
        kernel_options,
    )
    return out.squeeze(0).transpose(0, 1)  # (N, Hq, D)


def _decode_kernel(
    q, key_pool, value_pool, tables, lengths, block_positions, kv_num_blocks, kv_indices,
    block_size, scale, kernel_options,
):  # fmt: skip
    last_column = tables.shape[1] - 1

    def visible(b, h, q_idx, kv_idx):
        block = kv_idx // block_size
        logical = block_positions[block]
        held = tables[b, logical.clamp(0, last_column)] == block
        return held & (logical * block_size + kv_idx % block_size < lengths[b])

    blocks = (kv_num_blocks, kv_indices, DEFAULT_QUERY_TILE, block_size)
    return _attend(q, key_pool, value_pool, blocks, visible, scale, kernel_options)


def _prefill_kernel(
    q, key_pool, value_pool, tables, query_rows, query_positions, block_positions,
    kv_num_blocks, kv_indices, block_size, query_tile, scale, kernel_options,
):  # fmt: skip
    last_column = tables.shape[1] - 1

    def visible(b, h, q_idx, kv_idx):
        block = kv_idx // block_size
        logical = block_positions[block]
        held = tables[query_rows[q_idx], logical.clamp(0, last_column)] == block
        causal = logical * block_size + kv_idx % block_size <= query_positions[q_idx]
        return held & causal

    blocks = (kv_num_blocks, kv_indices, query_tile, block_size)
    return _attend(q, key_pool, value_pool, blocks, visible, scale, kernel_options, gqa=True)


def _attend(q, key_pool, value_pool, blocks, visible, scale, kernel_options, gqa=False):
    """FlexAttention of `q` over the pools, through the block mask of `blocks` ((counts,
    indices, query tile, block size): the kernel's key blocks per query tile) and `visible`."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    kv_num_blocks, kv_indices, query_tile, block_size = blocks
    mask = BlockMask.from_kv_blocks(
        kv_num_blocks,
        kv_indices,
        BLOCK_SIZE=(query_tile, block_size),
        mask_mod=visible,
        seq_lengths=(q.shape[2], key_pool.shape[2]),
        compute_q_blocks=False,
    )
    return flex_attention(
        q,
        key_pool,
        value_pool,
        block_mask=mask,
        scale=scale,
        enable_gqa=gqa,
        kernel_options=kernel_options,
    )


@functools.cache
def _compiled(kernel, dynamic: bool | None = False):
    """The kernel compiled once per process. `dynamic=False`: shapes fixed, a new shape
    compiles anew, and past torch's recompile limit (8) a `fullgraph` kernel raises, so a
    caller whose batch and token counts vary (an engine) passes None: the first shape
    compiles fixed, the next one compiles once with its changed sizes symbolic."""
    return torch.compile(kernel, dynamic=dynamic, fullgraph=True)


def _eager(kernel):
    """The kernel as is: FlexAttention's unfused reference path (float64 works)."""

    def run(*args):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without")
            return kernel(*args)

    return run
