"""The prefix cache of a paged engine: blocks found by their content, shared in place.

The slot engine's `PrefixCache` keeps copies of prompt blocks in a pool of its own and
copies a hit into the new prompt's slot. With a paged cache the blocks themselves are
the cache: a block whose keys and values are written is registered under the key of
its tokens and its prefix (`BlockAllocator.register`), stays findable after its
sequence ends (on the free list, least recently freed reused first), and a later
prompt's table points at it (`PagedModelRunner.share_blocks`): nothing is copied. The
interface is `PrefixCache`'s, so the scheduler and the admission logic are the same
for both engines; the block size is the prefill's query block, as there.

What is registered is what the scheduler stores (`store`), under the same rules as the
slot engine (prompts prefilled under the current weights, finished single-sample turns),
and a weight update forgets every key (`clear`).
"""

from __future__ import annotations

from asyncgrpo.inference.engine.paged.blocks import ROOT_KEY
from asyncgrpo.inference.engine.paged.runner import PagedModelRunner


class PagedPrefixCache:
    """`PrefixCache`'s lookup, load, store and clear over a paged runner's blocks."""

    def __init__(self, runner: PagedModelRunner, capacity_tokens: int):
        self.runner = runner
        self.enabled = capacity_tokens > 0
        self.block_size = runner.block_size

    def lookup(self, tokens: list[int], limit: int) -> tuple[list[int], bytes | None]:
        """The findable blocks of the longest run of leading full blocks within
        tokens[:limit], and the key of the first block that is not findable (None when
        every full block within the limit is)."""
        if not self.enabled:
            return [], None
        allocator, size = self.runner.allocator, self.block_size
        hits: list[int] = []
        parent = ROOT_KEY
        for b in range(limit // size):
            key, block = allocator.find(parent, tokens[b * size : (b + 1) * size])
            if block is None:
                return hits, key
            hits.append(block)
            parent = key
        return hits, None

    def load(self, blocks: list[int], slot: int) -> int:
        """The slot starts with `blocks` as its positions 0..; returns their token count."""
        if not blocks:
            return 0
        tokens = [t for block in blocks for t in self.runner.allocator.content(block).tokens]
        self.runner.share_blocks(slot, blocks, tokens)
        return len(tokens)

    def store(self, tokens: list[int], slot: int, length: int) -> None:
        """Make the full blocks of tokens[:length], written in `slot`, findable."""
        if not self.enabled:
            return
        sequence = self.runner.tables.sequences.get(slot)
        if sequence is None or length <= sequence.written:
            return
        if sequence.tokens[:length] != list(tokens[:length]):
            raise RuntimeError(f"slot {slot} does not hold the tokens it is asked to cache")
        self.runner.tables.mark_written(slot, length)

    def clear(self) -> None:
        """Forget every block's content (the weights changed)."""
        self.runner.allocator.forget_contents()
