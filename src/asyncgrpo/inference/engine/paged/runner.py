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

Attention, `attention="gather"` (the default): each step gathers the rows' keys and values from the
pools into the slot runner's dense layout and calls the slot runner's attention
(`engine/attention.py`), so on a CPU the paged engine computes exactly what the slot
engine computes, bit for bit (tests/unit/test_paged_runner.py). It costs one copy of
the keys a step reads, which a CPU does not need to pay (the slot runner stays the CPU
default). `attention="flex"`: FlexAttention over the pools themselves (`paged/attention.py`),
the block tables as its block mask, nothing gathered: what a GPU runs (compiled there,
its key tile no larger than a block; on a CPU it runs eagerly and is tested against the
gathered keys, in float64 to 1e-10 and through the engine for equal greedy tokens).

Memory: every slot can grow to the full context, so the pools hold `slots x
blocks per context` blocks plus the prefix cache's, allocated as zero pages the OS maps
on first touch (`PagedKVCache(zeroed=True)`): untouched blocks cost nothing. A budgeted pool with
preemption on `OutOfBlocks` is the GPU engine's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncgrpo.inference.engine.attention import (
    decode_attention,
    decode_spans,
    prefill_attention,
    prefill_pieces,
)
from asyncgrpo.inference.engine.forward_steps import PackedChunks
from asyncgrpo.inference.engine.paged.attention import (
    DEFAULT_QUERY_TILE,
    PagedDecodeMetadata,
    PagedPrefillMetadata,
    kernel_table_width,
)
from asyncgrpo.inference.engine.paged.attention import decode_attention as paged_decode
from asyncgrpo.inference.engine.paged.attention import prefill_attention as paged_prefill
from asyncgrpo.inference.engine.paged.blocks import BlockAllocator
from asyncgrpo.inference.engine.paged.buckets import pad_decode_batch
from asyncgrpo.inference.engine.paged.cache import PagedKVCache
from asyncgrpo.inference.engine.paged.tables import BlockTables, SequenceBlocks
from asyncgrpo.inference.engine.runner import ModelRunner


@dataclass
class PagedDecodeStep:
    """A decode step over the pools: where the new keys go and what each row reads."""

    slot_mapping: torch.Tensor  # (B,) int64: pool slot of each row's new token
    lengths: torch.Tensor  # (B,) int64: keys each row attends over
    spans: list
    gather: torch.Tensor | None = None  # (B, K) int64: pool slots of positions 0..K-1
    flex: PagedDecodeMetadata | None = None


@dataclass
class PagedPrefillStep:
    """A prefill over the pools: the packed tokens' slots and what each row reads."""

    packed: PackedChunks
    slot_mapping: torch.Tensor  # (N,) int64: pool slot of each packed new token
    gather: torch.Tensor | None = None  # (R, K) int64: pool slots of positions 0..K-1
    pieces: list = field(default_factory=list)
    flex: PagedPrefillMetadata | None = None


class PagedModelRunner(ModelRunner):
    """`ModelRunner` whose slots are block tables over one paged KV cache."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_slots: int,
        max_model_len: int,
        block_size: int,
        prefix_blocks: int = 0,
        attention: str = "gather",
    ):
        if attention not in ("gather", "flex"):
            raise ValueError(f"attention {attention!r}: gather or flex")
        self.block_size = block_size
        self.prefix_blocks = prefix_blocks
        self.attention = attention
        weight = next(model.parameters())
        # FlexAttention compiled where the speed is wanted, on CUDA (float64 has no Triton
        # kernel); on a CPU it runs eagerly, the exact reference (the CPU engine's fast path
        # is `gather`, and Inductor's CPU kernel costs tens of seconds a shape to compile)
        self._compiled = weight.device.type == "cuda" and weight.dtype != torch.float64
        # a key tile no larger than a block, as Triton's kernels need (test_paged_cuda.py)
        self._kernel_options = {"BLOCK_N": block_size} if block_size < DEFAULT_QUERY_TILE else {}
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
            self.device,
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
            pair = [source.blocks[full]], [blocks[full]]
            self.cache.copy_blocks(*(torch.tensor(b, device=self.device) for b in pair))
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

    def _append_decoded(self, tokens: torch.Tensor, positions: torch.Tensor) -> list[int]:
        """Room for each decode row's new token (slots 0..B-1); their pool slots."""
        mapping = []
        for slot, (token, position) in enumerate(zip(tokens.tolist(), positions.tolist())):
            mapping += self._extend(slot, position, [token])
        return mapping

    def _gather_index(self, slots: list[int], key_len: int) -> torch.Tensor:
        """(R, key_len) pool slots of each slot's positions 0..key_len-1; positions past
        a slot's blocks read the scratch block (their attention weight is zero)."""
        width = -(-key_len // self.block_size)
        table = self.tables.block_table_tensor(slots, max(width, 1), self.device).long()  # (R, W)
        positions = torch.arange(key_len, device=self.device)
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
        key_len = max(s.key_len for s in spans)
        self.ensure_capacity(key_len)
        mapping = self._append_decoded(tokens, positions)
        rows = list(range(len(mapping)))
        lengths = (positions + 1).to(self.device)
        step = PagedDecodeStep(torch.tensor(mapping, device=self.device), lengths, spans)
        if self.attention == "gather":
            step.gather = self._gather_index(rows, key_len)
        else:
            step.flex = PagedDecodeMetadata.build(
                self._kernel_table(rows),
                step.lengths.to(torch.int32),
                self.tables.block_positions_tensor(self.device),
                self.block_size,
            )
        return step

    @torch.inference_mode()
    def decode_in_bucket(
        self, tokens: torch.Tensor, positions: torch.Tensor, bucket: int
    ) -> torch.Tensor:
        """`decode`, with the batch padded to `bucket` rows as a CUDA graph of that bucket
        replays it (buckets.py: the dummies write and read the scratch block); the shapes of
        everything after the bookkeeping depend on the bucket alone. Flex attention only."""
        if self.attention != "flex":
            raise ValueError("a bucketed decode attends with attention='flex'")
        self._refresh()
        rows = tokens.shape[0]
        mapping = self._append_decoded(tokens, positions)
        batch = pad_decode_batch(
            tokens.to(self.device),
            positions.to(self.device),
            torch.tensor(mapping, device=self.device),
            (positions + 1).to(self.device, torch.int32),
            self._kernel_table(list(range(rows))),
            bucket,
            self.block_size,
        )
        flex = PagedDecodeMetadata.build(
            batch.block_tables,
            batch.lengths,
            self.tables.block_positions_tensor(self.device),
            self.block_size,
        )
        step = PagedDecodeStep(batch.slot_mapping, batch.lengths, [], flex=flex)
        return batch.real(self._decode_forward(batch.token_ids, batch.positions, step))

    def _decode_attend(self, i: int, q, k, v, step: PagedDecodeStep) -> torch.Tensor:
        self.cache.write(i, k[:, :, 0], v[:, :, 0], step.slot_mapping)
        if step.flex is not None:
            batch = q.shape[0]
            flat = q.reshape(batch, self.num_heads, self.head_dim)  # heads kv-major, as folded
            attn = paged_decode(flat, *self.cache.pools(i), step.flex, **self._flex_options())
            return attn.view(q.shape)
        keys, values = self._gathered(i, step.gather)  # (B, kv_heads, K, D)
        return decode_attention(q, keys, values, step.spans, step.lengths)

    def _prefill_step(self, packed: PackedChunks, chunks) -> PagedPrefillStep:
        self.ensure_capacity(max(packed.ends))
        mapping = []
        for slot, chunk, start in zip(packed.slots, chunks, packed.starts, strict=True):
            mapping += self._extend(slot, start, list(chunk))
        step = PagedPrefillStep(packed, torch.tensor(mapping, device=self.device))
        if self.attention == "gather":
            step.gather = self._gather_index(packed.slots, max(packed.ends))
            rows = list(range(len(packed.slots)))  # the gathered rows
            step.pieces = prefill_pieces(rows, packed.starts, packed.ends)
        else:
            positions = torch.tensor(packed.starts)[packed.rows] + packed.cols  # (N,)
            step.flex = PagedPrefillMetadata.build(
                self._kernel_table(packed.slots),
                packed.rows.to(self.device, torch.int32),
                positions.to(self.device, torch.int32),
                self.tables.block_positions_tensor(self.device),
                self.block_size,
            )
        return step

    def _prefill_attend(self, i: int, q, k, v, step: PagedPrefillStep) -> torch.Tensor:
        self.cache.write(i, k[0].transpose(0, 1), v[0].transpose(0, 1), step.slot_mapping)
        packed = step.packed
        if step.flex is not None:
            flat = q[0].transpose(0, 1)  # (N, heads, D)
            options = self._flex_options(prefill=True)
            return paged_prefill(flat, *self.cache.pools(i), step.flex, **options)
        keys, values = self._gathered(i, step.gather)  # (R, kv_heads, K, D)
        by_row = packed.by_row(q[0].transpose(0, 1))  # (R, heads, T, D)
        attn = prefill_attention(by_row, keys, values, step.pieces)
        return attn[packed.rows, :, packed.cols]

    def _flex_options(self, prefill: bool = False) -> dict:
        """How FlexAttention runs: compiled with sizes that may vary between steps (batch
        rows, packed tokens) symbolic after the first (`attention._compiled`), or eagerly.
        A prefill of fewer than 128 tokens keeps the main kernel: Inductor would take its
        decoding kernel, which refuses GQA groups that are not powers of two in some torch
        releases (Qwen2.5-0.5B's is 7)."""
        if not self._compiled:
            return {"compiled": False}
        options = dict(self._kernel_options)
        if prefill:
            options["FORCE_USE_FLEX_ATTENTION"] = True
        return {"compiled": True, "kernel_options": options or None, "dynamic": None}

    def _kernel_table(self, slots: list[int]) -> torch.Tensor:
        """The slots' block tables as wide as the attention kernel reads them."""
        per_slot = -(-self.max_model_len // self.block_size)
        device_type = self.cache.keys.device.type
        width = kernel_table_width(device_type, self.cache.num_blocks, per_slot)
        return self.tables.block_table_tensor(slots, width, self.device)
