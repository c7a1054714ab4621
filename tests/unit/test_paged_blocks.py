"""The paged KV cache's bookkeeping: blocks, reference counts, prefix sharing, slot
mappings, all-or-nothing allocation, and the pools' sizes and writes."""

from __future__ import annotations

import hashlib

import pytest
import torch

from asyncgrpo.inference.engine.paged import blocks as blocks_module
from asyncgrpo.inference.engine.paged.blocks import (
    ROOT_KEY,
    SCRATCH_BLOCK,
    BlockAllocator,
    OutOfBlocks,
    block_key,
)
from asyncgrpo.inference.engine.paged.cache import (
    PagedKVCache,
    blocks_for_budget,
    bytes_per_block,
)
from asyncgrpo.inference.engine.paged.tables import BlockTables

BLOCK = 4


def make_tables(num_blocks: int = 16) -> BlockTables:
    return BlockTables(BlockAllocator(num_blocks, BLOCK))


def admitted(tables: BlockTables, seq_id: int, prompt: list[int]) -> int:
    """Admit and write a prompt whole (as a prefill would), returning the cached count."""
    cached = tables.admit(seq_id, prompt)
    tables.mark_written(seq_id, len(prompt))
    return cached


def test_a_block_key_hashes_its_parent_key_and_tokens():
    tokens = b"".join(t.to_bytes(8, "little", signed=True) for t in (1, 2, -3))
    want = hashlib.blake2b(ROOT_KEY + tokens, digest_size=16).digest()
    assert block_key(ROOT_KEY, [1, 2, -3]) == want
    first = block_key(ROOT_KEY, [1, 2, 3, 4])
    assert block_key(first, [5, 6, 7, 8]) != block_key(ROOT_KEY, [5, 6, 7, 8])
    assert block_key(ROOT_KEY, [1, 2, 3, 5]) != first


def test_blocks_are_counted_freed_and_reused_least_recently_freed_first():
    allocator = BlockAllocator(4, BLOCK)
    got = [allocator.allocate(i) for i in range(3)]
    assert sorted(got) == [1, 2, 3] and SCRATCH_BLOCK not in got
    with pytest.raises(OutOfBlocks):
        allocator.allocate(0)
    allocator.retain(got[0])
    allocator.release(got[0])
    assert allocator.free_count == 0  # still held once
    allocator.release(got[2])
    allocator.release(got[0])
    assert allocator.allocate(0) == got[2]  # freed first, reused first
    with pytest.raises(ValueError, match="not held"):
        allocator.release(got[0])  # already free
    with pytest.raises(ValueError, match="scratch"):
        allocator.retain(SCRATCH_BLOCK)


def test_a_prompt_shares_the_cached_blocks_of_its_prefix():
    tables = make_tables()
    assert admitted(tables, 0, list(range(10))) == 0
    cached = tables.admit(1, list(range(8)) + [90, 91, 92])
    assert cached == 8
    first, second = tables.sequences[0].blocks, tables.sequences[1].blocks
    assert second[:2] == first[:2] and not set(second[2:]) & set(first)
    assert [tables.allocator.refs[b] for b in first] == [2, 2, 1]


def test_a_hit_leaves_the_last_prompt_token_to_compute():
    tables = make_tables()
    admitted(tables, 0, list(range(8)))  # two full blocks
    assert tables.admit(1, list(range(8))) == 4  # not 8: the last token's logits are needed
    assert tables.admit(2, list(range(9))) == 8


def test_only_written_blocks_are_found_and_a_weight_change_forgets_them():
    tables = make_tables()
    tables.admit(0, list(range(8)))
    assert tables.admit(1, list(range(9))) == 0  # 0's blocks are not written yet
    tables.mark_written(0, 5)
    assert tables.admit(2, list(range(9))) == 4  # its first block is
    tables.allocator.forget_contents()
    assert tables.admit(3, list(range(9))) == 0


def test_a_freed_prefix_stays_findable_until_its_block_is_reused():
    tables = make_tables(num_blocks=5)  # four usable blocks
    admitted(tables, 0, list(range(12)))  # three blocks, all full
    prefix = tables.sequences[0].blocks
    tables.free(0)
    assert tables.allocator.free_count == 4
    assert tables.admit(1, list(range(9))) == 8  # taken back from the free list
    assert tables.sequences[1].blocks[:2] == prefix[:2]
    tables.free(1)
    admitted(tables, 2, [70] * 16)  # needs every free block: the cached ones are reused
    tables.free(2)
    assert tables.admit(3, list(range(9))) == 0


def test_free_releases_the_last_blocks_first():
    tables = make_tables(num_blocks=4)
    admitted(tables, 0, list(range(12)))
    blocks = tables.sequences[0].blocks
    tables.free(0)
    assert tables.allocator.allocate(0) == blocks[-1]  # the shared prefix goes last


def test_a_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(blocks_module, "block_key", lambda parent, tokens: b"k" * 16)
    tables = make_tables()
    admitted(tables, 0, [1, 2, 3, 4, 5])
    assert tables.admit(1, [9, 9, 9, 9, 9]) == 0  # the same key, other tokens
    assert tables.admit(2, [1, 2, 3, 4, 5]) == 4


def test_append_crosses_block_boundaries_and_maps_slots():
    tables = make_tables()
    admitted(tables, 0, [1, 2, 3])
    for token in range(6):
        tables.append(0, [token])
    seq = tables.sequences[0]
    assert len(seq.tokens) == 9 and len(seq.blocks) == 3
    slots = tables.slot_mapping(0, 0, 9)
    want = [seq.blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(9)]
    assert slots == want and len(set(slots)) == 9
    assert [tables.allocator.positions[b] for b in seq.blocks] == [0, 1, 2]
    with pytest.raises(ValueError, match="not all in the blocks"):
        tables.slot_mapping(0, 8, 13)


def test_running_out_of_blocks_changes_nothing():
    tables = make_tables(num_blocks=4)  # three usable blocks
    admitted(tables, 0, list(range(8)))
    free_before, refs_before = tables.allocator.free_count, list(tables.allocator.refs)
    with pytest.raises(OutOfBlocks) as failed:
        tables.admit(1, list(range(4)) + list(range(50, 58)))  # one hit and two new
    assert (failed.value.needed, failed.value.free) == (2, 1)
    assert 1 not in tables.sequences
    assert tables.allocator.refs == refs_before and tables.allocator.free_count == free_before
    tables.append(0, [8, 9, 10, 11])
    with pytest.raises(OutOfBlocks):
        tables.append(0, [12])
    assert len(tables.sequences[0].tokens) == 12


def test_reviving_a_cached_block_counts_against_the_free_blocks():
    tables = make_tables(num_blocks=4)
    admitted(tables, 0, list(range(8)))
    tables.free(0)  # both blocks free, still cached
    admitted(tables, 1, [60])  # one block in use; two free, both cached
    with pytest.raises(OutOfBlocks):  # 1 hit revived + 2 new > 2 free
        tables.admit(2, list(range(8)) + [1, 2, 3, 4, 5])


def test_a_fork_shares_full_blocks_and_copies_the_partial_one():
    tables = make_tables()
    admitted(tables, 0, list(range(6)))
    source, target = tables.fork(0, 1)
    parent, child = tables.sequences[0], tables.sequences[1]
    assert child.blocks[0] == parent.blocks[0] and source == parent.blocks[1] != target
    assert child.blocks[1] == target and child.tokens == parent.tokens
    cache = PagedKVCache(2, 1, 3, 16, BLOCK, torch.float32)
    cache.keys.normal_()
    cache.values.normal_()
    cache.copy_blocks(torch.tensor([source]), torch.tensor([target]))
    for pool in (cache.keys, cache.values):
        torch.testing.assert_close(
            pool[:, :, target * BLOCK : (target + 1) * BLOCK],
            pool[:, :, source * BLOCK : (source + 1) * BLOCK],
            rtol=0,
            atol=0,
        )
    admitted(tables, 2, list(range(8)))
    assert tables.fork(2, 3) is None  # no partial block to copy


def test_the_block_table_tensor_is_padded_with_the_scratch_block():
    tables = make_tables()
    admitted(tables, 0, list(range(9)))
    admitted(tables, 1, [5])
    table = tables.block_table_tensor([1, 0], width=4)
    assert table.dtype == torch.int32 and table.shape == (2, 4)
    assert table[0].tolist() == tables.sequences[1].blocks + [SCRATCH_BLOCK] * 3
    assert table[1, :3].tolist() == tables.sequences[0].blocks
    assert tables.lengths_tensor([1, 0]).tolist() == [1, 9]
    with pytest.raises(ValueError, match="3 blocks, the table is 2 wide"):
        tables.block_table_tensor([0], width=2)


def test_a_block_holds_every_layer_s_keys_and_values():
    # Qwen2.5-0.5B: 24 layers, 2 key heads of 64, bfloat16, 16-position blocks
    assert bytes_per_block(24, 2, 64, torch.bfloat16, 16) == 24 * 2 * 64 * 2 * 2 * 16
    assert blocks_for_budget(10 * 196_608 + 5, 24, 2, 64, torch.bfloat16, 16) == 10
    with pytest.raises(ValueError, match="at least 2"):
        blocks_for_budget(196_608, 24, 2, 64, torch.bfloat16, 16)
    cache = PagedKVCache.for_budget(4096, 2, 2, 4, BLOCK, torch.float32)
    assert cache.num_blocks == 4096 // (2 * 2 * 4 * 2 * 4 * BLOCK) == 8
    assert cache.nbytes <= 4096 and cache.pools(1)[0].shape == (1, 2, 8 * BLOCK, 4)


def test_a_write_lands_at_its_slots_and_the_scratch_block_starts_zeroed():
    cache = PagedKVCache(2, 2, 3, 6, BLOCK, torch.float64)
    assert not cache.keys[:, :, :BLOCK].any() and not cache.values[:, :, :BLOCK].any()
    # the other blocks start as uninitialised memory, which may hold NaN (never equal to
    # itself): give them known finite values, so that "untouched" can be compared
    rest = cache.keys[:, :, BLOCK:]
    rest.copy_(torch.randn(rest.shape, dtype=rest.dtype))
    before_keys = cache.keys.clone()
    slots = torch.tensor([5, 17, 4])
    k = torch.randn(3, 2, 3, dtype=torch.float64)
    v = torch.randn(3, 2, 3, dtype=torch.float64)
    cache.write(1, k, v, slots)
    for i, slot in enumerate(slots.tolist()):
        for head in range(2):
            assert torch.equal(cache.keys[1, head, slot], k[i, head])
            assert torch.equal(cache.values[1, head, slot], v[i, head])
    untouched = torch.ones(6 * BLOCK, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(cache.keys[0], before_keys[0])
    assert torch.equal(cache.keys[1][:, untouched], before_keys[1][:, untouched])
