"""Block tables: which physical blocks hold each sequence's positions, and where a step writes.

A sequence's table lists its blocks in logical order; position p lives in block
`table[p // block_size]` at offset `p % block_size`, i.e. at slot
`table[p // block_size] * block_size + p % block_size` of the pool (cache.py). The
engine's step asks this module for three things: the slots its new tokens' keys and
values go to (`slot_mapping`, one `index_copy_` per pool and layer), the padded
`(B, max_blocks)` table and the lengths the attention kernel reads, and — before the
step — room for the tokens (`admit` for a prompt, `append` for what decode adds).

Every call that allocates is all or nothing: it raises `OutOfBlocks` before changing
anything, so a scheduler can preempt a sequence (`free`) and try again.

A prompt's full blocks are looked up by content (blocks.py) and shared when found;
a prefix hit is capped so that at least one prompt token is computed (its logits
give the first sampled token). Blocks become findable once their keys and values are
written (`mark_written`), so no other sequence reads a block the forward has not
filled yet.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from asyncgrpo.inference.engine.paged.blocks import (
    ROOT_KEY,
    SCRATCH_BLOCK,
    BlockAllocator,
    OutOfBlocks,
)


@dataclass
class SequenceBlocks:
    """One sequence's blocks and tokens.

    `tokens`: every token whose keys and values are in, or are about to be written
    to, the blocks; `written`: how many leading ones are in the cache; `keys`: the
    content keys of its leading full blocks that are written (the chain continues
    from the last one)."""

    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    written: int = 0
    keys: list[bytes] = field(default_factory=list)


class BlockTables:
    """The block tables of the running sequences, over one `BlockAllocator`."""

    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.sequences: dict[int, SequenceBlocks] = {}

    def blocks_needed(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def prefix_hits(self, prompt: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """The cached blocks (and their keys) of the longest run of `prompt`'s leading
        full blocks, leaving at least its last token to compute."""
        size = self.block_size
        hits: list[int] = []
        keys: list[bytes] = []
        parent = ROOT_KEY
        for index in range((len(prompt) - 1) // size):
            key, block = self.allocator.find(parent, prompt[index * size : (index + 1) * size])
            if block is None:
                break
            hits.append(block)
            keys.append(key)
            parent = key
        return hits, keys

    def admit(self, seq_id: int, prompt: Sequence[int]) -> int:
        """Blocks for a new sequence's prompt, sharing the cached prefix; returns how
        many leading prompt tokens are already in the cache (their keys and values need
        no prefill). Raises OutOfBlocks, allocating nothing, when blocks run short."""
        if seq_id in self.sequences:
            raise ValueError(f"sequence {seq_id} already has blocks")
        if not prompt:
            raise ValueError("an empty prompt has nothing to compute")
        hits, keys = self.prefix_hits(prompt)
        revived = sum(self.allocator.is_free(block) for block in hits)  # leave the free list
        fresh = self.blocks_needed(len(prompt)) - len(hits)
        if fresh + revived > self.allocator.free_count:
            raise OutOfBlocks(fresh + revived, self.allocator.free_count)
        for block in hits:
            self.allocator.retain(block)
        blocks = hits + [self.allocator.allocate(len(hits) + i) for i in range(fresh)]
        cached = len(hits) * self.block_size
        self.sequences[seq_id] = SequenceBlocks(blocks, list(prompt), cached, keys)
        return cached

    def append(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Room for `tokens` after the sequence's current ones (decode: the token just
        sampled, whose keys and values the next step writes)."""
        seq = self.sequences[seq_id]
        fresh = self.blocks_needed(len(seq.tokens) + len(tokens)) - len(seq.blocks)
        if fresh > self.allocator.free_count:
            raise OutOfBlocks(fresh, self.allocator.free_count)
        for _ in range(fresh):
            seq.blocks.append(self.allocator.allocate(len(seq.blocks)))
        seq.tokens.extend(tokens)

    def fork(self, parent_id: int, child_id: int) -> tuple[int, int] | None:
        """A new sequence continuing from all of a written sequence's tokens (the other
        samples of one prompt): it shares the parent's full blocks, and gets a copy of
        its partial last block. Returns (source block, new block) for the cache to copy
        (`PagedKVCache.copy_blocks`), None when there is no partial block."""
        parent = self.sequences[parent_id]
        if child_id in self.sequences:
            raise ValueError(f"sequence {child_id} already has blocks")
        if parent.written != len(parent.tokens):
            raise ValueError(f"sequence {parent_id} has tokens not yet written")
        full = len(parent.tokens) // self.block_size
        partial = len(parent.blocks) > full
        if partial and not self.allocator.free_count:
            raise OutOfBlocks(1, 0)
        for block in parent.blocks[:full]:
            self.allocator.retain(block)
        blocks = parent.blocks[:full]
        if partial:
            blocks.append(self.allocator.allocate(full))
        keys = parent.keys[:full]
        self.sequences[child_id] = SequenceBlocks(blocks, list(parent.tokens), parent.written, keys)
        return (parent.blocks[full], blocks[full]) if partial else None

    def mark_written(self, seq_id: int, written: int) -> None:
        """The keys and values of the first `written` tokens are in the cache: their
        full blocks become findable by later prompts."""
        seq = self.sequences[seq_id]
        if not seq.written <= written <= len(seq.tokens):
            raise ValueError(f"written {written}: outside {seq.written}..{len(seq.tokens)}")
        seq.written = written
        size = self.block_size
        for index in range(len(seq.keys), written // size):
            parent = seq.keys[-1] if seq.keys else ROOT_KEY
            tokens = seq.tokens[index * size : (index + 1) * size]
            seq.keys.append(self.allocator.register(seq.blocks[index], parent, tokens))

    def free(self, seq_id: int) -> None:
        """Release a finished or preempted sequence's blocks, its last blocks first so
        that a shared prefix is the last to be reused for something else."""
        seq = self.sequences.pop(seq_id)
        for block in reversed(seq.blocks):
            self.allocator.release(block)

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        """Pool slots of positions start..end-1 of a sequence (they must have blocks)."""
        seq = self.sequences[seq_id]
        if not 0 <= start <= end <= len(seq.blocks) * self.block_size:
            raise ValueError(f"positions {start}..{end - 1} are not all in the blocks")
        size = self.block_size
        return [seq.blocks[p // size] * size + p % size for p in range(start, end)]

    def block_table_tensor(
        self, seq_ids: Iterable[int], width: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """The `(B, width)` int32 table of the given sequences, padded with the scratch
        block (attention never reads a padding entry: a row's length stops it)."""
        rows = [self.sequences[s].blocks for s in seq_ids]
        longest = max((len(blocks) for blocks in rows), default=0)
        if longest > width:
            raise ValueError(f"a sequence holds {longest} blocks, the table is {width} wide")
        table = torch.full((len(rows), width), SCRATCH_BLOCK, dtype=torch.int32)  # (B, W)
        for row, blocks in enumerate(rows):
            table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        return table.to(device)

    def lengths_tensor(
        self, seq_ids: Iterable[int], device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """`(B,)` int32: the positions each sequence attends over (its tokens)."""
        lengths = [len(self.sequences[s].tokens) for s in seq_ids]
        return torch.tensor(lengths, dtype=torch.int32, device=device)

    def block_positions_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """`(num_blocks,)` int32: each block's logical index (see `BlockAllocator`)."""
        return torch.from_numpy(self.allocator.positions.copy()).to(device)
