"""The varlen layout (`trainer/varlen.py`): gathering each shared prompt in front of its
completions and scattering the outputs back gives the packed row's block-mask attention.

The flash kernel needs a GPU (`tests/integration/test_cuda_trainer.py` runs it); here a
plain per-sequence causal sdpa stands in for it, under both of the signatures torch
releases give `varlen_attn`, so the layout, the scale and the grouped KV heads are
checked against the dense block mask on any machine.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from asyncgrpo.learning.trainer import varlen
from asyncgrpo.learning.trainer.packing import pack_sequences, packed_attention_forward

HEADS, KV_HEADS, DIM = 4, 2, 8


def causal_per_sequence(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, gqa=False):
    """What the kernel computes: causal attention within each [cu[i], cu[i+1])."""
    assert torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
    assert max_q == max(int(b - a) for a, b in zip(cu_q, cu_q[1:]))
    outs = []
    for a, b in zip(cu_q.tolist(), cu_q[1:].tolist()):
        # (L, H, D) -> (1, H, L, D)
        qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa
        )
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def new_signature(
    q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
):
    assert window_size == (-1, 0)
    return causal_per_sequence(q, k, v, cu_q, cu_k, max_q, max_k, scale, enable_gqa)


def old_signature(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False):
    assert is_causal and q.shape[1] == k.shape[1], "the old kernel takes equal head counts"
    return causal_per_sequence(q, k, v, cu_q, cu_k, max_q, max_k)


@pytest.fixture(params=[new_signature, old_signature], ids=["window_size", "is_causal"])
def kernel(request, monkeypatch):
    module = types.ModuleType("torch.nn.attention.varlen")
    module.varlen_attn = request.param
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", module)
    varlen._parameters.cache_clear()
    yield request.param
    varlen._parameters.cache_clear()


def shared_prompt_batch():
    """Two groups behind shared prompts, a loner, and a group of one."""
    g = torch.Generator().manual_seed(0)

    def rand(n):
        return torch.randint(0, 50, (n,), generator=g).tolist()

    p1, p2 = rand(7), rand(3)
    seqs = [p1 + rand(5), rand(9), p1 + rand(1), p2 + rand(4), p1 + rand(8), p2 + rand(2), rand(6)]
    return pack_sequences(seqs, [7, 4, 7, 3, 7, 3, 2])


def prompt_tree_batch():
    """Prompts sharing a 17-token run, one extending another: segments two prompts deep."""
    run = list(range(1, 18))
    p1, p2 = run + [20, 21], run + [30]
    p3 = p1 + [40, 41]
    seqs = [p1 + [5, 6], p2 + [7, 8, 9], p3 + [10], p1 + [11, 12, 13], p3 + [14, 15], p2 + [16]]
    packed = pack_sequences(seqs, [19, 18, 21, 19, 21, 18])
    assert any(
        seg.prefix is not None and packed.segments[seg.prefix].prefix is not None
        for seg in packed.segments
    ), "no segment two prompts deep"
    return packed


@pytest.mark.parametrize("batch", [shared_prompt_batch, prompt_tree_batch])
@pytest.mark.parametrize("scaling", [None, 0.2])
def test_varlen_layout_equals_the_block_mask_attention(kernel, scaling, batch):
    packed = batch()
    assert any(seg.prefix is not None for seg in packed.segments), "no shared prompt to test"
    n = packed.input_ids.shape[1]
    g = torch.Generator().manual_seed(1)
    query = torch.randn(1, HEADS, n, DIM, generator=g, requires_grad=True)
    key = torch.randn(1, KV_HEADS, n, DIM, generator=g, requires_grad=True)
    value = torch.randn(1, KV_HEADS, n, DIM, generator=g, requires_grad=True)
    want = F.scaled_dot_product_attention(
        query, key, value, attn_mask=packed.block_mask(), scale=scaling, enable_gqa=True
    ).transpose(1, 2)  # (1, N, H, D)
    layout = varlen.varlen_layout(packed.segments, torch.device("cpu"))
    got = varlen.varlen_attention(query, key, value, layout, scaling)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    weights = torch.randn(want.shape, generator=g)
    want_grads = torch.autograd.grad((want * weights).sum(), (query, key, value))
    got_grads = torch.autograd.grad((got * weights).sum(), (query, key, value))
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_layout_puts_each_prompt_in_front_of_its_completions():
    packed = pack_sequences([[1, 2, 3, 4, 9], [1, 2, 3, 5, 6], [7, 8, 9]], [3, 3, 1])
    # the packed row (a sequence's last token is no input): 1 2 3 | 4 | 5 | 7 8
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5, 7, 8]]
    layout = varlen.varlen_layout(packed.segments, torch.device("cpu"))
    # varlen sequences: the prompt; prompt + 4; prompt + 5; 7 8
    assert layout.gather.tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 4, 5, 6]
    assert layout.cu_seqlens.tolist() == [0, 3, 7, 11, 13]
    assert layout.max_len == 4
    # each packed row's output: the prompt's from its own sequence, a completion's from
    # the tail of its sequence
    assert layout.scatter.tolist() == [0, 1, 2, 6, 10, 11, 12]


def test_float32_queries_under_autocast_take_the_varlen_kernel_in_the_autocast_dtype(monkeypatch):
    """RoPE hands attention float32 queries under bf16 autocast; the packed forward must
    still call the varlen kernel (in bf16, as sdpa would attend), not the per-segment
    fallback, which is what it did before."""
    calls = []

    def recording_kernel(
        q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
    ):
        calls.append(q.dtype)
        q, k, v = q.float(), k.float(), v.float()
        out = new_signature(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_q,
            max_k,
            scale=scale,
            window_size=window_size,
            enable_gqa=enable_gqa,
        )
        return out.to(torch.bfloat16)

    module = types.ModuleType("torch.nn.attention.varlen")
    module.varlen_attn = recording_kernel
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", module)
    varlen._parameters.cache_clear()
    packed = shared_prompt_batch()
    n = packed.input_ids.shape[1]
    g = torch.Generator().manual_seed(2)
    query, key, value = (
        torch.randn(1, h, n, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS)
    )
    layout = varlen.varlen_layout(packed.segments, torch.device("cpu"))
    forward = dict(packed_segments=packed.segments, packed_varlen=layout, scaling=None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = packed_attention_forward(None, query, key, value, None, **forward)
    assert calls == [torch.bfloat16] and got.dtype == torch.bfloat16
    want = F.scaled_dot_product_attention(
        query, key, value, attn_mask=packed.block_mask(), enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    calls.clear()
    packed_attention_forward(None, query, key, value, None, **forward)  # no autocast: fp32
    assert calls == [], "float32 attention outside autocast must not be rounded to half"
    varlen._parameters.cache_clear()
