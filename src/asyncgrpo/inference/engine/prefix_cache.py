"""Prompt-prefix cache: keys and values of token blocks that earlier prompts computed.

RL prompts repeat themselves: every chat prompt starts with the same system
message, and a multi-turn agent's next prompt is its whole conversation so far.
Prefilling those tokens again costs as much as generating them. This cache
keeps the keys and values of full 16-token blocks of recent prompts; a new
prompt copies its longest cached run of leading blocks into its slot and
prefills only the rest.

A block is identified by (the id of the block before it, its tokens), so a hit
is exact — two prompts share a block only if they share every token up to its
end — and no hash can collide. Ids are never reused: evicting a block makes its
descendants unreachable, and they age out of the LRU order by themselves.

Keys and values depend on the weights, so the engine clears the cache whenever
they change. Storage is one preallocated pool per layer for keys and for
values, `(blocks, kv_heads, BLOCK, head_dim)`, so loading and storing a run of
blocks is one indexed copy per layer.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import torch

from asyncgrpo.inference.engine.attention import QUERY_BLOCK
from asyncgrpo.inference.engine.runner import ModelRunner

# tokens per cached block: the prefill's query block, so a prompt that starts after a
# hit computes its remaining blocks exactly as a prefill of the whole prompt does
BLOCK = QUERY_BLOCK

_ROOT = -1  # parent id of a prompt's first block


class PrefixCache:
    """LRU cache of prompt blocks' keys and values, bounded by a number of tokens."""

    def __init__(self, runner: ModelRunner, capacity_tokens: int):
        self.runner = runner
        self.capacity = capacity_tokens // BLOCK
        self._ids = itertools.count()
        self._by_key: dict[tuple[int, tuple[int, ...]], int] = {}
        self._blocks: OrderedDict[int, tuple[tuple[int, tuple[int, ...]], int]] = OrderedDict()
        self._free: list[int] = list(range(self.capacity))
        self._k_pool: list[torch.Tensor] = []
        self._v_pool: list[torch.Tensor] = []

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def _pools(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if not self._k_pool:  # allocated on first use
            r = self.runner
            shape = (self.capacity, r.num_kv_heads, BLOCK, r.head_dim)
            self._k_pool = [torch.empty(shape, dtype=r.dtype) for _ in r.layers]
            self._v_pool = [torch.empty(shape, dtype=r.dtype) for _ in r.layers]
        return self._k_pool, self._v_pool

    def lookup(self, tokens: list[int], limit: int) -> tuple[list[int], tuple | None]:
        """Longest cached run of leading blocks within tokens[:limit].

        Returns the ids of the cached blocks and the key of the first block that is not
        cached (None when every full block within the limit is cached).
        """
        if not self.enabled:
            return [], None
        hits: list[int] = []
        missing = None
        parent = _ROOT
        for b in range(limit // BLOCK):
            key = (parent, tuple(tokens[b * BLOCK : (b + 1) * BLOCK]))
            parent = self._by_key.get(key)
            if parent is None:
                missing = key
                break
            hits.append(parent)
        for block in hits:
            self._blocks.move_to_end(block)
        return hits, missing

    def load(self, blocks: list[int], slot: int) -> int:
        """Copy cached blocks into positions 0.. of `slot`; returns the number of tokens."""
        if not blocks:
            return 0
        k_pool, v_pool = self._pools()
        length = len(blocks) * BLOCK
        self.runner.ensure_capacity(length)
        index = torch.tensor([self._blocks[b][1] for b in blocks])
        for layer, (k, v) in enumerate(zip(self.runner.k_cache, self.runner.v_cache, strict=True)):
            # (m, kv_heads, BLOCK, D) -> (kv_heads, m * BLOCK, D)
            k[slot, :, :length] = k_pool[layer][index].transpose(0, 1).flatten(1, 2)
            v[slot, :, :length] = v_pool[layer][index].transpose(0, 1).flatten(1, 2)
        return length

    def store(self, tokens: list[int], slot: int, length: int) -> None:
        """Cache the full blocks of tokens[:length], whose keys and values are in `slot`."""
        if not self.enabled:
            return
        new: list[tuple[int, int]] = []  # (block number in the prompt, pool index)
        chain: set[int] = set()  # this prompt's blocks: never evicted to make room for it
        parent = _ROOT
        for b in range(length // BLOCK):
            key = (parent, tuple(tokens[b * BLOCK : (b + 1) * BLOCK]))
            block = self._by_key.get(key)
            if block is None:
                pool_index = self._allocate(chain)
                if pool_index is None:
                    break
                block = next(self._ids)
                self._by_key[key] = block
                self._blocks[block] = (key, pool_index)
                new.append((b, pool_index))
            else:
                self._blocks.move_to_end(block)
            chain.add(block)
            parent = block
        if not new:
            return
        k_pool, v_pool = self._pools()
        first = new[0][0]  # new blocks are a contiguous tail of the run
        count = len(new)
        index = torch.tensor([p for _, p in new])
        span = slice(first * BLOCK, (first + count) * BLOCK)
        for layer, (k, v) in enumerate(zip(self.runner.k_cache, self.runner.v_cache, strict=True)):
            kv_heads, _, dim = k.shape[1:]
            k_pool[layer][index] = (
                k[slot, :, span].view(kv_heads, count, BLOCK, dim).transpose(0, 1)
            )
            v_pool[layer][index] = (
                v[slot, :, span].view(kv_heads, count, BLOCK, dim).transpose(0, 1)
            )

    def _allocate(self, keep: set[int]) -> int | None:
        """A free pool index, evicting the least recently used block not in `keep`."""
        if not self._free:
            oldest = next(iter(self._blocks), None)
            if oldest is None or oldest in keep:
                return None
            _, (key, pool_index) = self._blocks.popitem(last=False)
            del self._by_key[key]
            return pool_index
        return self._free.pop()

    def clear(self) -> None:
        """Forget every block (the weights changed). The pools stay allocated."""
        self._by_key.clear()
        self._blocks.clear()
        self._free = list(range(self.capacity))
