"""The decode attention over the slot cache against a plain loop: one (row, query head) at a
time, softmax written out by hand, over exactly the row's own positions."""

from __future__ import annotations

import math

import pytest
import torch

from asyncgrpo.engine.attention import KEY_BLOCK, decode_attention, decode_spans


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_a_plain_loop(dtype):
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

    got = decode_attention(q, k_cache, v_cache, spans)

    assert got.dtype == dtype and got.shape == q.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        got.double(), reference(q, k_cache, v_cache, positions), atol=tolerance, rtol=tolerance
    )
