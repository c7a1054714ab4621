"""The decode attention over the slot cache against a plain loop: one (row, query head) at a
time, softmax written out by hand, over exactly the row's own positions. Both paths: the
C kernel (native_attention.py) and PyTorch's, per span."""

from __future__ import annotations

import math

import pytest
import torch

from asyncgrpo.inference.engine import native_attention
from asyncgrpo.inference.engine.attention import KEY_BLOCK, decode_attention, decode_spans


def reference(q, k_cache, v_cache, positions):
    """q (B, kv_heads, group, D); caches (slots, kv_heads, capacity, D); slot r = row r."""
    out = torch.zeros_like(q, dtype=torch.float64)
    b, kv_heads, group, d = q.shape
    for r in range(b):
        n = int(positions[r]) + 1  # keys 0..pos
        for h in range(kv_heads):
            keys = k_cache[r, h, :n].double()
            values = v_cache[r, h, :n].double()
            for g in range(group):
                scores = [float(q[r, h, g].double() @ keys[j]) / math.sqrt(d) for j in range(n)]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                for j in range(n):
                    out[r, h, g] += weights[j] / total * values[j]
    return out


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    """Which decode attention runs: the C kernel (skipped where it cannot be built) or PyTorch's."""
    if request.param == "native":
        if native_attention.kernel() is None:
            pytest.skip("the decode-attention kernel could not be built here (see its warning)")
    else:
        monkeypatch.setattr(native_attention, "usable", lambda *tensors: False)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_a_plain_loop(dtype, path):
    torch.manual_seed(0)
    # lengths on both sides of a key block, so rows fall into several spans, one of them
    # with a row of another span inside its slot range
    positions = torch.tensor([3, KEY_BLOCK + 5, 10, KEY_BLOCK - 1, 2 * KEY_BLOCK + 1, 0])
    b, kv_heads, group, d, capacity = len(positions), 2, 3, 16, 3 * KEY_BLOCK
    q = torch.randn(b, kv_heads, group, d).to(dtype)
    k_cache = torch.randn(b + 2, kv_heads, capacity, d).to(dtype)
    v_cache = torch.randn(b + 2, kv_heads, capacity, d).to(dtype)
    spans = decode_spans(positions, max_model_len=capacity)
    assert len(spans) == 3 and any(s.members is not None for s in spans)

    got = decode_attention(q, k_cache, v_cache, spans, positions + 1)

    assert got.dtype == dtype and got.shape == q.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        got.double(), reference(q, k_cache, v_cache, positions), atol=tolerance, rtol=tolerance
    )


def test_the_kernel_is_built_where_a_compiler_is():
    """CI machines have a C compiler: there the kernel must build, not fall back silently."""
    if native_attention.shutil.which("cc") is None and native_attention.shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    assert native_attention.kernel() is not None


def test_a_row_does_not_depend_on_its_batch_or_the_thread_count(path):
    """Row 0 alone, among others, and on one or two threads: the same bits."""
    torch.manual_seed(1)
    positions = torch.tensor([37, 5, 90, 64])
    q = torch.randn(4, 2, 3, 16).bfloat16()
    k_cache, v_cache = (torch.randn(4, 2, 128, 16).bfloat16() for _ in range(2))

    def row0(batch: int, threads: int) -> torch.Tensor:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            spans = decode_spans(positions[:batch], max_model_len=128)
            out = decode_attention(q[:batch], k_cache, v_cache, spans, positions[:batch] + 1)
        finally:
            torch.set_num_threads(before)
        return out[0]

    alone = row0(1, 1)
    assert torch.equal(alone, row0(4, 1))
    if path == "native":  # PyTorch's kernels split work by thread count (attention.py)
        assert torch.equal(alone, row0(4, 2))
