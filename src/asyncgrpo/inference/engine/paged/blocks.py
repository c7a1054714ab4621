"""Physical KV blocks: a free list, reference counts, and content keys for prefix sharing.

The paged cache cuts every sequence's keys and values into blocks of `block_size`
positions; a block is a row range of one pool shared by all sequences. This module
owns which block is free, how many sequences hold each one, and which full blocks
can be found again by their contents.

Content keys follow nano-vllm's design: a full block's key hashes its tokens together
with its predecessor's key, so a key names the whole prefix up to the block's end and
two prompts share a block only if they agree on every token before it. Where this
departs from nano-vllm: the hash is BLAKE2b over the token ids as little-endian int64
(the same in every process, unlike Python's `hash`), and a hit is confirmed by
comparing the stored parent key and tokens, so a collision can never hand out another
prefix's keys and values (the same exactness the slot engine's `prefix_cache.py` gets
from keying on (parent id, tokens)). Unlike that cache's ids, a key depends only on
content: a block evicted and computed again gets its old key back, and the blocks
after it become reachable again.

A block whose last holder lets go keeps its key while it waits on the free list, so a
later prompt can take it back (a prefix-cache hit at no copy cost); `allocate` hands
out the block freed longest ago, which forgets its key. Block 0 is the scratch block:
never handed out, it is where padded rows of a CUDA-graph batch write (buckets.py).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SCRATCH_BLOCK = 0  # never allocated: the write target of padding rows
ROOT_KEY = b"\x00" * 16  # the parent key of a sequence's first block


class OutOfBlocks(RuntimeError):
    """Not enough free blocks for a request; nothing was allocated. A scheduler frees
    (preempts) a running sequence and tries again, or waits."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"needs {needed} free KV blocks, {free} are free")
        self.needed = needed
        self.free = free


def block_key(parent_key: bytes, tokens: Sequence[int]) -> bytes:
    """The content key of a full block: BLAKE2b-128 of its parent's key and its tokens."""
    digest = hashlib.blake2b(parent_key, digest_size=16)
    digest.update(np.asarray(tokens, dtype="<i8").tobytes())
    return digest.digest()


@dataclass(frozen=True)
class BlockContent:
    """What a registered block holds: its key, its parent's key and its tokens."""

    key: bytes
    parent_key: bytes
    tokens: tuple[int, ...]


class BlockAllocator:
    """Blocks 1..num_blocks-1 with reference counts; block 0 is the scratch block.

    `positions[b]` is the logical block index (position // block_size) of block b in
    the sequences that hold it. It is the same in all of them: a shared block is a
    full prefix block, and its key fixes how many blocks come before it. Attention
    reads it to turn a physical position back into a logical one (attention.py).
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks {num_blocks}: needs the scratch block and one more")
        if block_size < 1:
            raise ValueError(f"block_size {block_size} must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refs = [0] * num_blocks
        self.positions = np.zeros(num_blocks, dtype=np.int32)  # scratch: logical block 0
        # free blocks, least recently freed first; cached ones keep their content
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._content: dict[int, BlockContent] = {}
        self._by_key: dict[bytes, int] = {}

    @property
    def free_count(self) -> int:
        return len(self._free)

    def is_free(self, block: int) -> bool:
        return block in self._free

    def allocate(self, position: int) -> int:
        """A block for logical block `position` of a sequence, with one reference; the
        least recently freed one, whose cached content is forgotten."""
        if not self._free:
            raise OutOfBlocks(1, 0)
        block, _ = self._free.popitem(last=False)
        self._forget(block)
        self.refs[block] = 1
        self.positions[block] = position
        return block

    def retain(self, block: int) -> None:
        """One more holder of `block` (a prefix hit); takes it off the free list."""
        if block == SCRATCH_BLOCK:
            raise ValueError("the scratch block is never held")
        self._free.pop(block, None)
        self.refs[block] += 1

    def release(self, block: int) -> None:
        """One holder fewer; the last one puts the block on the free list, content kept."""
        if self.refs[block] <= 0:
            raise ValueError(f"block {block} is not held")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self._free[block] = None

    def find(self, parent_key: bytes, tokens: Sequence[int]) -> tuple[bytes, int | None]:
        """(the key of a full block of `tokens` after `parent_key`, the block that holds
        exactly that content, or None)."""
        key = block_key(parent_key, tokens)
        block = self._by_key.get(key)
        if block is None:
            return key, None
        content = self._content[block]
        if content.parent_key != parent_key or content.tokens != tuple(tokens):
            return key, None  # a hash collision: not the same prefix
        return key, block

    def register(self, block: int, parent_key: bytes, tokens: Sequence[int]) -> bytes:
        """Make full `block` findable by its content; returns its key. A block whose
        content another block already has stays private (the first one is kept)."""
        key, holder = self.find(parent_key, tokens)
        if holder is None and key not in self._by_key:
            self._by_key[key] = block
            self._content[block] = BlockContent(key, parent_key, tuple(tokens))
        return key

    def content(self, block: int) -> BlockContent:
        """What a findable block holds (KeyError for one that is not findable)."""
        return self._content[block]

    def forget_contents(self) -> None:
        """No block is findable any more (the weights changed, so did every key and
        value); blocks in use stay with their sequences."""
        self._by_key.clear()
        self._content.clear()

    def _forget(self, block: int) -> None:
        content = self._content.pop(block, None)
        if content is not None:
            del self._by_key[content.key]
