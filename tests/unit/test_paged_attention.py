"""Paged decode and prefill attention against dense causal attention per sequence.

The reference never touches the pools: each sequence's keys and values are kept
contiguous, `(length, kv_heads, D)`, and a query at position p attends over rows
0..p with the key heads repeated for GQA, softmax in float64. The paged side writes
the same keys and values through block tables and slot mappings into pools first
filled with noise, so a query that reads a block it does not hold, or a position past
its own, moves the result far beyond the tolerances.

float64 runs FlexAttention eagerly (mask_mod over every pool position): exact to
1e-12. float32 runs the compiled kernel, which visits only the blocks the block mask
lists: within 2e-6 of the float64 reference (outputs are O(1); float32 rounding of
D=8 dot products and a softmax over <= 17 keys stays near 1e-7). The compiled tests
are `heavy`: a first compile in a cold Inductor cache took 35 s on 2 shared cores (5 s
warm); the float64 ones check the same math in a few seconds.
"""

from __future__ import annotations

import pytest
import torch

from asyncgrpo.inference.engine.paged.attention import (
    PagedDecodeMetadata,
    PagedPrefillMetadata,
    decode_attention,
    kernel_table_width,
    prefill_attention,
)
from asyncgrpo.inference.engine.paged.blocks import SCRATCH_BLOCK, BlockAllocator
from asyncgrpo.inference.engine.paged.buckets import pad_decode_batch
from asyncgrpo.inference.engine.paged.cache import PagedKVCache
from asyncgrpo.inference.engine.paged.tables import BlockTables
from asyncgrpo.learning.trainer.compiled_layers import cpp_compiler_found

BLOCK, BLOCKS, HEADS, KV_HEADS, DIM = 4, 32, 14, 2, 8  # 14 query heads over 2: Qwen2.5-0.5B's
SEQS = (0, 1, 2, 3)
needs_compiler = pytest.mark.skipif(
    not cpp_compiler_found(), reason="inductor's CPU kernels need g++"
)


class Scenario:
    """Four sequences in the pools (with 4-position blocks): 0 has 10 tokens (three
    blocks, the last partial), 1 shares 0's first two blocks (a prefix hit) and adds 5
    of its own, 2 has one token, 3 has 17 (five blocks). `kv[s]` holds sequence s's keys
    and values contiguously."""

    def __init__(self, dtype: torch.dtype, block: int = BLOCK, dim: int = DIM, device="cpu"):
        gen = torch.Generator().manual_seed(0)
        self.block = block
        self.tables = BlockTables(BlockAllocator(BLOCKS, block))
        self.cache = PagedKVCache(1, KV_HEADS, dim, BLOCKS, block, torch.float64)
        self.cache.keys.normal_(generator=gen).mul_(3)  # noise where nothing was written
        self.cache.values.normal_(generator=gen).mul_(3)
        shared = list(range(2 * block))
        prompts = {0: list(range(2 * block + block // 2)), 1: shared + [50, 51, 52, 53, 54]}
        prompts.update({2: [7], 3: list(range(100, 100 + 4 * block + 1))})
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.cached: dict[int, int] = {}
        for s in SEQS:
            k = torch.randn(len(prompts[s]), KV_HEADS, dim, generator=gen, dtype=torch.float64)
            v = torch.randn(len(prompts[s]), KV_HEADS, dim, generator=gen, dtype=torch.float64)
            if s == 1:  # the same tokens at the same positions: the same keys and values
                k[: len(shared)] = self.kv[0][0][: len(shared)]
                v[: len(shared)] = self.kv[0][1][: len(shared)]
            self.kv[s] = (k, v)
            self.cached[s] = self.tables.admit(s, prompts[s])
            self.write(s, self.cached[s], len(prompts[s]))
        self.cache.keys = self.cache.keys.to(device, dtype)
        self.cache.values = self.cache.values.to(device, dtype)
        self.device = device
        self.width = kernel_table_width(torch.device(device).type, BLOCKS, max_blocks_per_seq=8)

    def write(self, s: int, start: int, end: int) -> None:
        slots = torch.tensor(self.tables.slot_mapping(s, start, end))
        k, v = self.kv[s]
        self.cache.write(0, k[start:end], v[start:end], slots)
        self.tables.mark_written(s, end)

    def decode_meta(self) -> PagedDecodeMetadata:
        return PagedDecodeMetadata.build(
            self.tables.block_table_tensor(SEQS, self.width, self.device),
            self.tables.lengths_tensor(SEQS, self.device),
            self.tables.block_positions_tensor(self.device),
            self.block,
        )


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: int) -> torch.Tensor:
    """q (Hq, D) at `position` over k, v (length, Hkv, D): (Hq, D), float64, on the CPU."""
    q = q.cpu()
    group = HEADS // KV_HEADS
    keys = k[: position + 1].double().transpose(0, 1).repeat_interleave(group, 0)  # (Hq, p+1, D)
    values = v[: position + 1].double().transpose(0, 1).repeat_interleave(group, 0)
    scores = (keys @ q.double().unsqueeze(-1)).squeeze(-1) / q.shape[-1] ** 0.5  # (Hq, p+1)
    return (scores.softmax(-1).unsqueeze(1) @ values).squeeze(1)


def decode_reference(scene: Scenario, q: torch.Tensor) -> torch.Tensor:
    rows = [reference(q[s], *scene.kv[s], len(scene.kv[s][0]) - 1) for s in SEQS]
    return torch.stack(rows)  # (B, Hq, D)


@pytest.fixture(scope="module")
def scene64() -> Scenario:
    return Scenario(torch.float64)


def test_the_scenario_shares_a_prefix_and_crosses_block_boundaries(scene64):
    seqs = scene64.tables.sequences
    assert scene64.cached == {0: 0, 1: 8, 2: 0, 3: 0}
    assert seqs[1].blocks[:2] == seqs[0].blocks[:2]
    assert seqs[1].blocks[2] != seqs[0].blocks[2]
    assert [len(seqs[s].blocks) for s in SEQS] == [3, 4, 1, 5]


def test_decode_matches_dense_attention_in_float64(scene64):
    q = torch.randn(len(SEQS), HEADS, DIM, dtype=torch.float64)
    key_pool, value_pool = scene64.cache.pools(0)
    out = decode_attention(q, key_pool, value_pool, scene64.decode_meta(), compiled=False)
    torch.testing.assert_close(out, decode_reference(scene64, q), rtol=0, atol=1e-12)


def test_decode_ignores_the_noise_of_blocks_a_row_does_not_hold(scene64):
    # the scenario's pools are noise outside the written slots: a kernel that read
    # them would be off by far more than the tolerance; here it must not be
    q = torch.randn(len(SEQS), HEADS, DIM, dtype=torch.float64)
    key_pool, value_pool = scene64.cache.pools(0)
    meta = scene64.decode_meta()
    out = decode_attention(q, key_pool, value_pool, meta, compiled=False)
    meta.lengths = meta.lengths + 1  # one position past each row: noise or another row
    leaked = decode_attention(q, key_pool, value_pool, meta, compiled=False)
    assert (leaked - out).abs().amax(dim=(1, 2)).min() > 1e-3


def packed_queries(scene: Scenario) -> tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor]:
    """Prefill of every sequence's uncached tokens, packed: (row, position) per query."""
    pairs = [(s, p) for s in SEQS for p in range(scene.cached[s], len(scene.kv[s][0]))]
    rows = torch.tensor([s for s, _ in pairs], dtype=torch.int32)
    positions = torch.tensor([p for _, p in pairs], dtype=torch.int32)
    return pairs, rows, positions


def prefill_meta(scene: Scenario, rows, positions, tile: int) -> PagedPrefillMetadata:
    return PagedPrefillMetadata.build(
        scene.tables.block_table_tensor(SEQS, scene.width, scene.device),
        rows.to(scene.device),
        positions.to(scene.device),
        scene.tables.block_positions_tensor(scene.device),
        scene.block,
        query_tile=tile,
    )


def test_prefill_after_a_prefix_hit_matches_dense_causal_attention_in_float64(scene64):
    pairs, rows, positions = packed_queries(scene64)
    assert len(pairs) == 10 + 5 + 1 + 17  # sequence 1 prefills only past its hit
    q = torch.randn(len(pairs), HEADS, DIM, dtype=torch.float64)
    meta = prefill_meta(scene64, rows, positions, tile=8)  # tiles mix sequences
    key_pool, value_pool = scene64.cache.pools(0)
    out = prefill_attention(q, key_pool, value_pool, meta, compiled=False)
    want = torch.stack([reference(q[i], *scene64.kv[s], p) for i, (s, p) in enumerate(pairs)])
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


def test_a_prefill_tile_lists_each_block_it_needs_once(scene64):
    _, rows, positions = packed_queries(scene64)
    meta = prefill_meta(scene64, rows, positions, tile=16)
    seqs = scene64.tables.sequences
    # tile 0: all 10 of sequence 0, then sequence 1's 5 (positions 8..12) and 2's one
    need = seqs[0].blocks + seqs[1].blocks[2:] + seqs[2].blocks
    assert meta.kv_num_blocks[0, 0, 0].item() == len(need) == 3 + 2 + 1
    assert sorted(meta.kv_indices[0, 0, 0, : len(need)].tolist()) == sorted(need)


def test_padding_rows_write_only_the_scratch_block_and_leave_real_rows_alone():
    scene = Scenario(torch.float64)
    q = torch.randn(len(SEQS), HEADS, DIM, dtype=torch.float64)
    meta = scene.decode_meta()
    tokens = torch.zeros(len(SEQS), dtype=torch.int64)
    last = [len(scene.kv[s][0]) - 1 for s in SEQS]
    slots = torch.tensor([scene.tables.slot_mapping(s, p, p + 1)[0] for s, p in zip(SEQS, last)])
    padded = pad_decode_batch(
        tokens, tokens, slots, meta.lengths, meta.block_tables, bucket=8, block_size=BLOCK
    )
    before = scene.cache.keys.clone()
    dummies = padded.bucket - padded.real_rows
    new = torch.randn(dummies, KV_HEADS, DIM, dtype=torch.float64)
    scene.cache.write(0, new, new, padded.slot_mapping[padded.real_rows :])
    scratch = slice(SCRATCH_BLOCK * BLOCK, (SCRATCH_BLOCK + 1) * BLOCK)
    changed = (scene.cache.keys != before).any(dim=(0, 1, 3)).nonzero().flatten()
    assert set(changed.tolist()) <= set(range(BLOCKS * BLOCK)[scratch])
    padded_meta = PagedDecodeMetadata.build(
        padded.block_tables, padded.lengths, scene.tables.block_positions_tensor(), BLOCK
    )
    q_padded = torch.cat([q, torch.randn(dummies, HEADS, DIM, dtype=torch.float64)])
    key_pool, value_pool = scene.cache.pools(0)
    out = decode_attention(q_padded, key_pool, value_pool, padded_meta, compiled=False)
    torch.testing.assert_close(padded.real(out), decode_reference(scene, q), rtol=0, atol=1e-12)
    assert torch.isfinite(out).all()  # the dummies read the scratch block only


@pytest.fixture(scope="module")
def scene32() -> Scenario:
    return Scenario(torch.float32)


@pytest.mark.heavy
@needs_compiler
def test_compiled_decode_matches_the_reference_in_float32(scene32):
    key_pool, value_pool = scene32.cache.pools(0)
    q = torch.randn(len(SEQS), HEADS, DIM)
    out = decode_attention(q, key_pool, value_pool, scene32.decode_meta(), compiled=True)
    torch.testing.assert_close(out.double(), decode_reference(scene32, q), rtol=0, atol=2e-6)


@pytest.mark.heavy
@needs_compiler
def test_compiled_prefill_matches_the_reference_in_float32(scene32):
    key_pool, value_pool = scene32.cache.pools(0)
    pairs, rows, positions = packed_queries(scene32)
    q = torch.randn(len(pairs), HEADS, DIM)
    meta = prefill_meta(scene32, rows, positions, tile=16)
    out = prefill_attention(q, key_pool, value_pool, meta, compiled=True)
    want = torch.stack([reference(q[i], *scene32.kv[s], p) for i, (s, p) in enumerate(pairs)])
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-6)
