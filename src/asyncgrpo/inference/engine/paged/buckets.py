"""Decode batch sizes for CUDA graphs: the buckets, which one a batch takes, how it is padded.

A CUDA graph replays fixed shapes, so decode captures one graph per batch size of a
short list (nano-vllm's choice: 1, 2, 4, 8, then every 16 up to the most sequences) and
runs a batch of B rows in the graph of the smallest bucket >= B. The rows past B are
dummies: their token and position are 0, their one-entry block table points at the
scratch block (blocks.py) with a length of 1, and their slot mapping writes their keys
and values into the scratch block's first slot, so nothing a real sequence reads
changes. They attend over that one scratch position (finite: the scratch block starts
zeroed, cache.py) and their outputs are dropped (`PaddedDecodeBatch.real`).

Where this departs from nano-vllm: the last bucket is `max_num_seqs` itself when the
steps do not land on it, so every batch the scheduler can form has a graph; and the
steps are parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asyncgrpo.inference.engine.paged.blocks import SCRATCH_BLOCK

SMALL_BUCKETS = (1, 2, 4, 8)


def graph_buckets(
    max_num_seqs: int, small: Sequence[int] = SMALL_BUCKETS, step: int = 16
) -> list[int]:
    """Ascending batch sizes to capture: `small` (those <= max_num_seqs), then multiples
    of `step` up to max_num_seqs, then max_num_seqs if not already there."""
    if max_num_seqs < 1 or step < 1:
        raise ValueError(f"max_num_seqs {max_num_seqs} and step {step} must be positive")
    if any(size < 1 for size in small):
        raise ValueError(f"bucket sizes must be positive, got {list(small)}")
    sizes = {size for size in small if size <= max_num_seqs}
    sizes.update(range(step, max_num_seqs + 1, step))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def bucket_for(batch: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding `batch` rows (`buckets` ascending)."""
    if batch < 1:
        raise ValueError(f"a decode batch has at least one row, got {batch}")
    for size in buckets:
        if size >= batch:
            return size
    raise ValueError(f"batch {batch} is larger than the largest bucket {buckets[-1]}")


@dataclass
class PaddedDecodeBatch:
    """A decode batch padded to its bucket; rows `real_rows..` are dummies."""

    real_rows: int
    token_ids: torch.Tensor  # (bucket,) int64
    positions: torch.Tensor  # (bucket,) int64
    slot_mapping: torch.Tensor  # (bucket,) int64
    lengths: torch.Tensor  # (bucket,) int32
    block_tables: torch.Tensor  # (bucket, W) int32

    @property
    def bucket(self) -> int:
        return self.token_ids.shape[0]

    def real(self, rows: torch.Tensor) -> torch.Tensor:
        """The real rows of an output `(bucket, ...)`; the dummies' are dropped."""
        return rows[: self.real_rows]


def pad_decode_batch(
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    lengths: torch.Tensor,
    block_tables: torch.Tensor,
    bucket: int,
    block_size: int,
) -> PaddedDecodeBatch:
    """The batch's B rows, then `bucket - B` dummy rows (see the module docstring)."""
    rows = token_ids.shape[0]
    if not rows <= bucket:
        raise ValueError(f"{rows} rows do not fit bucket {bucket}")
    pad = bucket - rows

    def extend(values: torch.Tensor, fill: int) -> torch.Tensor:
        tail = torch.full((pad, *values.shape[1:]), fill, dtype=values.dtype)
        return torch.cat([values, tail.to(values.device)])

    return PaddedDecodeBatch(
        real_rows=rows,
        token_ids=extend(token_ids, 0),
        positions=extend(positions, 0),
        slot_mapping=extend(slot_mapping, SCRATCH_BLOCK * block_size),
        lengths=extend(lengths, 1),
        block_tables=extend(block_tables, SCRATCH_BLOCK),
    )
