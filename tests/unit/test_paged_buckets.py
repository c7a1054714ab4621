"""CUDA-graph decode buckets: the sizes, the bucket of a batch, and its dummy rows."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo.inference.engine.paged.blocks import SCRATCH_BLOCK
from asyncgrpo.inference.engine.paged.buckets import bucket_for, graph_buckets, pad_decode_batch


def test_buckets_are_the_small_sizes_then_steps_up_to_the_most_sequences():
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40]  # every batch has a graph
    assert graph_buckets(3) == [1, 2, 3]
    assert graph_buckets(1) == [1]
    assert graph_buckets(64, small=(1, 4), step=32) == [1, 4, 32, 64]
    with pytest.raises(ValueError, match="positive"):
        graph_buckets(0)
    with pytest.raises(ValueError, match="positive"):
        graph_buckets(8, small=(0, 2))


def test_a_batch_takes_the_smallest_bucket_that_holds_it():
    buckets = graph_buckets(40)
    chosen = {batch: bucket_for(batch, buckets) for batch in (1, 3, 5, 8, 9, 17, 33, 40)}
    assert chosen == {1: 1, 3: 4, 5: 8, 8: 8, 9: 16, 17: 32, 33: 40, 40: 40}
    with pytest.raises(ValueError, match="larger than the largest bucket 40"):
        bucket_for(41, buckets)
    with pytest.raises(ValueError, match="at least one row"):
        bucket_for(0, buckets)


def test_dummy_rows_point_at_the_scratch_block_and_are_dropped():
    block = 16
    tables = torch.tensor([[3, 4, 0], [7, 0, 0], [5, 6, 9]], dtype=torch.int32)
    padded = pad_decode_batch(
        token_ids=torch.tensor([11, 12, 13]),
        positions=torch.tensor([20, 3, 40]),
        slot_mapping=torch.tensor([4 * block + 4, 7 * block + 3, 9 * block + 8]),
        lengths=torch.tensor([21, 4, 41], dtype=torch.int32),
        block_tables=tables,
        bucket=bucket_for(3, graph_buckets(8)),
        block_size=block,
    )
    assert padded.bucket == 4 and padded.real_rows == 3
    assert padded.token_ids.tolist() == [11, 12, 13, 0]
    assert padded.positions.tolist() == [20, 3, 40, 0]
    assert padded.slot_mapping[3].item() // block == SCRATCH_BLOCK
    assert padded.lengths.tolist() == [21, 4, 41, 1] and padded.lengths.dtype == torch.int32
    assert padded.block_tables[3].tolist() == [SCRATCH_BLOCK] * 3
    assert torch.equal(padded.block_tables[:3], tables)
    out = torch.arange(4 * 2).view(4, 2)
    assert padded.real(out).tolist() == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="do not fit bucket 2"):
        pad_decode_batch(
            padded.token_ids, padded.positions, padded.slot_mapping, padded.lengths,
            padded.block_tables, bucket=2, block_size=block,
        )  # fmt: skip
