"""The LM head's compiled passes (`trainer/fused_head.py`) against float64 autograd, and the
head's log-probs through them against its eager ops."""

import logging

import pytest
import torch

from asyncgrpo.learning.trainer import fused_head
from asyncgrpo.learning.trainer.logprobs import lm_head_token_logprobs


@pytest.fixture
def fused_everywhere(monkeypatch):
    """Every chunk, however small, takes the compiled path (as SmolLM2's do)."""
    monkeypatch.setattr(fused_head, "FUSE_MIN_ELEMENTS", 0)
    monkeypatch.setitem(fused_head._state, "broken", False)


def reference_loss(product, targets, temperature, g_lp, g_ent):
    """Σ g_lp·log p(target) + Σ g_ent·H of softmax(product / T), in float64."""
    logp = torch.log_softmax(product / temperature, dim=-1)
    picked = logp.gather(1, targets[:, None]).squeeze(1)
    entropy = -(logp.exp() * logp).sum(-1)
    return picked, entropy, (g_lp * picked).sum() + (g_ent * entropy).sum()


@pytest.mark.parametrize("rows", [1, 5, 33])  # the compiled code takes any row count
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-5)])
def test_passes_match_float64_autograd(rows, dtype, tol):
    torch.manual_seed(rows)
    product = (torch.randn(rows, 700) * 4).to(dtype)
    targets = torch.randint(0, 700, (rows,))
    g_lp, g_ent = torch.randn(rows), torch.randn(rows)
    temperature = 0.7

    logprobs, lse, mean_z = fused_head.chunk_stats(product, targets, temperature)
    grad = fused_head.logit_gradient(product, lse, targets, g_lp, mean_z, g_ent, temperature)

    exact = product.double().requires_grad_()
    picked, entropy, loss = reference_loss(exact, targets, temperature, g_lp, g_ent)
    loss.backward()
    torch.testing.assert_close(logprobs.double(), picked.detach(), atol=tol, rtol=tol)
    torch.testing.assert_close((lse - mean_z).double(), entropy.detach(), atol=tol, rtol=tol)
    assert grad.dtype == dtype  # written in the product's dtype, for the head's matmul
    torch.testing.assert_close(grad.double(), exact.grad.to(dtype).double(), atol=tol, rtol=0.01)

    out = torch.empty_like(product)
    args = (product, lse, targets, g_lp, mean_z, g_ent, temperature)
    assert fused_head.logit_gradient(*args, out=out).data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, grad, atol=0, rtol=0)  # the same numbers, written there


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_head_logprobs_and_gradients_equal_the_eager_path(autocast, with_entropy, monkeypatch):
    torch.manual_seed(7)
    head = torch.nn.Linear(24, 500, bias=True)
    with torch.no_grad():
        head.weight.mul_(4)
    hidden = torch.randn(40, 24)
    targets = torch.randint(0, 500, (40,))
    w_lp, w_ent = torch.randn(40), torch.randn(40)

    def run(fuse_from: int):
        monkeypatch.setattr(fused_head, "FUSE_MIN_ELEMENTS", fuse_from)
        head.zero_grad()
        x = hidden.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            lp, ent = lm_head_token_logprobs(x, head, targets, 0.8, with_entropy, chunk_rows=16)
        loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if with_entropy else 0)
        loss.backward()
        grads = [x.grad] + [p.grad.clone() for p in head.parameters()]
        return [lp] + ([ent] if with_entropy else []), grads

    monkeypatch.setitem(fused_head._state, "broken", False)
    calls = []
    original = fused_head.logit_gradient
    monkeypatch.setattr(
        fused_head, "logit_gradient", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    eager_values, eager_grads = run(fuse_from=1 << 62)
    assert not calls
    values, grads = run(fuse_from=0)
    assert len(calls) == 3 and not fused_head._state["broken"]  # 40 rows in chunks of 16
    tol = 2e-2 if autocast else 1e-5  # bf16 logit gradients: both paths round them
    for got, want in zip(values, eager_values, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_a_failed_compile_falls_back_to_eager_ops_once(fused_everywhere, monkeypatch, caplog):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setitem(fused_head._state, "compiled", [no_compiler] * 3)
    product = torch.randn(3, 50)
    targets = torch.tensor([0, 7, 49])
    with caplog.at_level(logging.WARNING, logger=fused_head.__name__):
        logprobs, _, _ = fused_head.chunk_stats(product, targets, 1.0)
    want = torch.log_softmax(product, -1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, want)
    assert fused_head._state["broken"] and "did not compile" in caplog.text
    assert not fused_head.wanted(4096, 4096, torch.device("cpu"))  # eager from now on
