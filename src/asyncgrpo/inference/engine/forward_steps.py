"""What one forward step of the engine's runner carries from layer to layer.

A decode or prefill step computes its bookkeeping once (which rows, where their keys go,
what each row attends over) and every layer reads it. The slot runner and the paged
runner (`paged/runner.py`) fill these differently and share the layer loop
(`runner.py`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from asyncgrpo.inference.engine.attention import DecodeSpan, PrefillPiece


@dataclass
class DecodeStep:
    """A decode step's rows (B,), positions (B,), key lengths (B,) and key-length spans."""

    rows: torch.Tensor
    positions: torch.Tensor
    lengths: torch.Tensor
    spans: list[DecodeSpan]


@dataclass
class PackedChunks:
    """R prompt chunks packed end to end, N tokens: chunk r is row r's positions
    starts[r]..ends[r]-1 of slot slots[r]."""

    slots: list[int]
    starts: list[int]
    ends: list[int]
    rows: torch.Tensor  # (N,) the chunk of each packed token
    cols: torch.Tensor  # (N,) its index within its chunk
    offsets: list[int]  # (R + 1,) where each chunk starts in the packing
    width: int  # the longest chunk

    @classmethod
    def of(cls, slots: list[int], chunks: list[list[int]], starts: list[int]) -> PackedChunks:
        lengths = [len(c) for c in chunks]
        ends = [s + m for s, m in zip(starts, lengths, strict=True)]
        rows = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor(lengths))
        cols = torch.cat([torch.arange(m) for m in lengths])
        offsets = [0, *itertools.accumulate(lengths)]
        return cls(list(slots), list(starts), ends, rows, cols, offsets, max(lengths))

    def by_row(self, packed: torch.Tensor) -> torch.Tensor:
        """(N, heads, D) packed -> (R, heads, T, D) laid out by chunk, zero past each."""
        out = packed.new_zeros(len(self.slots), packed.shape[1], self.width, packed.shape[2])
        out[self.rows, :, self.cols] = packed
        return out


@dataclass
class PrefillStep:
    """A prefill's chunks and their attention pieces."""

    packed: PackedChunks
    pieces: list[PrefillPiece]
