"""The embedded engine's forward pass over a paged KV cache, behind the slot runner's interface.

The scheduler speaks of slots: decode runs slots 0..B-1, a prompt is prefilled into a
slot, a sample's slot is copied from its prompt's, and finished samples are compacted
by copying the last slot over theirs. `PagedModelRunner` keeps that interface and turns
each slot into a sequence of cache blocks (`tables.py`): copying a slot shares its full
blocks and copies only the partial last one, swapping two slots swaps two tables, and
the prefix cache (`PagedPrefixCache`) is the allocator's content keys, so a prompt's
cached prefix is shared in place instead of copied into its slot. That is what a GPU
engine needs (memory taken as sequences grow, prefixes shared, not copied); the same
code runs on the CPU, where it is tested against the slot runner.

Attention (`attention="gather"`): each step gathers the rows' keys and values from the
pools into the slot runner's dense layout and calls the slot runner's attention
(`engine/attention.py`), so on a CPU the paged engine computes exactly what the slot
engine computes, bit for bit (tests/unit/test_paged_runner.py). It costs one copy of
the keys a step reads, which a CPU does not need to pay (the slot runner stays the CPU
default); on a GPU, FlexAttention over the pools (`paged/attention.py`) replaces it.

Memory: every slot can grow to the full context, so the pools hold `slots x
blocks per context` blocks plus the prefix cache's, allocated as zero pages the OS maps
on first touch (`PagedKVCache(zeroed=True)`): untouched blocks cost nothing. A budgeted pool with
preemption on `OutOfBlocks` is the GPU engine's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncgrpo.inference.engine.attention import (
    decode_attention,
    decode_spans,
    prefill_attention,
    prefill_pieces,
)
from asyncgrpo.inference.engine.paged.blocks import BlockAllocator
from asyncgrpo.inference.engine.paged.cache import PagedKVCache
from asyncgrpo.inference.engine.paged.tables import BlockTables, SequenceBlocks
from asyncgrpo.inference.engine.runner import ModelRunner


@dataclass
class PagedDecodeStep:
    """A decode step over the pools: where the new keys go and what each row reads."""

    slot_mapping: torch.Tensor  # (B,) int64: pool slot of each row's new token
    gather: torch.Tensor  # (B, K) int64: pool slot of each row's positions 0..K-1
    lengths: torch.Tensor  # (B,) int64: keys each row attends over
    spans: list


@dataclass
class PagedPrefillStep:
    """A prefill over the pools: the packed tokens' slots and each row's positions."""

    slot_mapping: torch.Tensor  # (N,) int64: pool slot of each packed new token
    gather: torch.Tensor  # (R, K) int64: pool slot of each row's positions 0..K-1
    pieces: list


class PagedModelRunner(ModelRunner):
    """`ModelRunner` whose slots are block tables over one paged KV cache."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_slots: int,
        max_model_len: int,
        block_size: int,
        prefix_blocks: int = 0,
    ):
        self.block_size = block_size
        self.prefix_blocks = prefix_blocks
        super().__init__(model, num_slots, max_model_len)

    # ---- the cache: blocks instead of slot rows ------------------------------

    def ensure_capacity(self, length: int) -> None:
        """Every slot holds the whole context from the start; only the check is left."""
        if not hasattr(self, "cache"):
            self._allocate_pools()
        if length > self.max_model_len:
            raise ValueError(f"{length} positions: the context is {self.max_model_len}")

    def _allocate_pools(self) -> None:
        per_slot = -(-self.max_model_len // self.block_size)
        num_blocks = 1 + self.num_slots * per_slot + self.prefix_blocks  # block 0: scratch
        self.allocator = BlockAllocator(num_blocks, self.block_size)
        self.tables = BlockTables(self.allocator)
        self.cache = PagedKVCache(
            len(self.layers),
            self.num_kv_heads,
            self.head_dim,
            num_blocks,
            self.block_size,
            self.dtype,
            zeroed=True,
        )
        self.capacity = self.max_model_len

    def release_memory(self, keep: int = 256) -> None:
        """No sequence is live: every slot gives its blocks back (cached content stays
        findable until the blocks are reused)."""
        for slot in list(self.tables.sequences):
            self.tables.free(slot)

    def reset_slot(self, slot: int) -> None:
        """The slot starts over empty, its blocks released."""
        if slot in self.tables.sequences:
            self.tables.free(slot)

    def share_blocks(self, slot: int, blocks: list[int], tokens: list[int]) -> None:
        """The slot starts over holding `blocks` (full cached blocks of `tokens`)."""
        self.reset_slot(slot)
        for block in blocks:
            self.allocator.retain(block)
        keys = [self.allocator.content(block).key for block in blocks]
        self.tables.sequences[slot] = SequenceBlocks(list(blocks), list(tokens), len(tokens), keys)

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Slot `dst` holds the first `length` positions of slot `src`: the full blocks
        shared, the partial last one copied."""
        if src == dst or length == 0:
            return
        self.reset_slot(dst)
        source = self.tables.sequences[src]
        full = length // self.block_size
        for block in source.blocks[:full]:
            self.allocator.retain(block)
        blocks = source.blocks[:full]
        if length % self.block_size:
            blocks.append(self.allocator.allocate(full))
            pair = torch.tensor([source.blocks[full]]), torch.tensor([blocks[full]])
            self.cache.copy_blocks(*pair)
        written = min(source.written, full * self.block_size)
        keys = source.keys[: written // self.block_size]
        copy = SequenceBlocks(blocks, source.tokens[:length], written, keys)
        self.tables.sequences[dst] = copy

    def swap_slots(self, a: int, b: int, length: int) -> None:
        """Exchange two slots' sequences: their tables, nothing copied."""
        sequences = self.tables.sequences
        first, second = sequences.pop(a, None), sequences.pop(b, None)
        if second is not None:
            sequences[a] = second
        if first is not None:
            sequences[b] = first

    def _extend(self, slot: int, start: int, tokens: list[int]) -> list[int]:
        """Blocks for `tokens` at positions `start`.. of the slot; their pool slots."""
        if start == 0:
            self.reset_slot(slot)
            self.tables.sequences[slot] = SequenceBlocks()
        held = len(self.tables.sequences[slot].tokens)
        if held != start:
            raise RuntimeError(f"slot {slot} holds {held} positions, asked to write at {start}")
        self.tables.append(slot, tokens)
        return self.tables.slot_mapping(slot, start, start + len(tokens))

    def _gather_index(self, slots: list[int], key_len: int) -> torch.Tensor:
        """(R, key_len) pool slots of each slot's positions 0..key_len-1; positions past
        a slot's blocks read the scratch block (their attention weight is zero)."""
        width = -(-key_len // self.block_size)
        table = self.tables.block_table_tensor(slots, max(width, 1)).long()  # (R, W)
        positions = torch.arange(key_len)
        return (
            table[:, positions // self.block_size] * self.block_size + positions % self.block_size
        )

    def _gathered(self, i: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values at `index` (R, K), as (R, kv_heads, K, D)."""
        rows, width = index.shape
        flat = index.flatten()
        shape = (self.num_kv_heads, rows, width, self.head_dim)
        keys = self.cache.keys[i].index_select(1, flat).view(shape).transpose(0, 1)
        values = self.cache.values[i].index_select(1, flat).view(shape).transpose(0, 1)
        return keys.contiguous(), values.contiguous()

    # ---- the steps --------------------------------------------------------------

    def _decode_step(self, tokens: torch.Tensor, positions: torch.Tensor) -> PagedDecodeStep:
        spans = decode_spans(positions, self.max_model_len)
        self.ensure_capacity(max(s.key_len for s in spans))
        mapping = []
        for slot, (token, position) in enumerate(zip(tokens.tolist(), positions.tolist())):
            mapping += self._extend(slot, position, [token])
        index = self._gather_index(list(range(len(mapping))), max(s.key_len for s in spans))
        return PagedDecodeStep(torch.tensor(mapping), index, positions + 1, spans)

    def _decode_attend(self, i: int, q, k, v, step: PagedDecodeStep) -> torch.Tensor:
        self.cache.write(i, k[:, :, 0], v[:, :, 0], step.slot_mapping)
        keys, values = self._gathered(i, step.gather)  # (B, kv_heads, K, D)
        return decode_attention(q, keys, values, step.spans, step.lengths)

    def _prefill_step(self, slots, chunks, starts, ends) -> PagedPrefillStep:
        self.ensure_capacity(max(ends))
        mapping = []
        for slot, chunk, start in zip(slots, chunks, starts, strict=True):
            mapping += self._extend(slot, start, list(chunk))
        index = self._gather_index(list(slots), max(ends))
        pieces = prefill_pieces(list(range(len(slots))), starts, ends)  # rows of the gather
        return PagedPrefillStep(torch.tensor(mapping), index, pieces)

    def _prefill_attend(self, i: int, by_row, k, v, offsets, step: PagedPrefillStep):
        self.cache.write(i, k[0].transpose(0, 1), v[0].transpose(0, 1), step.slot_mapping)
        keys, values = self._gathered(i, step.gather)  # (R, kv_heads, K, D)
        return prefill_attention(by_row, keys, values, step.pieces)
