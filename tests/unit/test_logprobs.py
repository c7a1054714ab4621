"""Chunked and fused log-probs / entropy agree with a plain full log-softmax, gradients included."""

import pytest
import torch

from asyncgrpo.trainer.logprobs import (
    entropy_from_logits,
    lm_head_token_logprobs,
    selective_log_softmax,
)


def reference(logits, targets, temperature):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)  # (N, V)
    picked = logp.gather(1, targets[:, None]).squeeze(1)
    entropy = -(logp.exp() * logp).sum(-1)
    return picked, entropy


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_chunked_logprobs_and_entropy_match_full_log_softmax(temperature):
    torch.manual_seed(0)
    logits = torch.randn(37, 50) * 3
    targets = torch.randint(0, 50, (37,))
    want_lp, want_ent = reference(logits, targets, temperature)
    got_lp = selective_log_softmax(logits, targets, temperature, chunk_rows=8)
    got_ent = entropy_from_logits(logits, temperature, chunk_rows=8)
    assert got_lp.dtype == torch.float32
    torch.testing.assert_close(got_lp.double(), want_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_ent.double(), want_ent, atol=1e-5, rtol=1e-5)


def test_chunked_logprobs_gradient_matches_reference():
    torch.manual_seed(1)
    logits = (torch.randn(21, 40) * 2).requires_grad_()
    targets = torch.randint(0, 40, (21,))
    weights = torch.randn(21)
    (selective_log_softmax(logits, targets, 0.8, chunk_rows=5) * weights).sum().backward()
    got = logits.grad.clone()
    logits.grad = None
    want_lp, _ = reference(logits, targets, 0.8)
    (want_lp * weights).sum().backward()
    torch.testing.assert_close(got, logits.grad.float(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_lm_head_matches_reference_values_and_gradients(temperature, bias):
    torch.manual_seed(2)
    head = torch.nn.Linear(16, 300, bias=bias)
    with torch.no_grad():
        head.weight.mul_(4)
    hidden = torch.randn(45, 16, requires_grad=True)
    targets = torch.randint(0, 300, (45,))
    w_lp, w_ent = torch.randn(45), torch.randn(45)

    lp, ent = lm_head_token_logprobs(
        hidden, head, targets, temperature, with_entropy=True, chunk_rows=7
    )
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    got = [hidden.grad.clone()] + [p.grad.clone() for p in head.parameters()]
    hidden.grad = None
    head.zero_grad()

    want_lp, want_ent = reference(head(hidden), targets, temperature)
    ((want_lp * w_lp).sum() + (want_ent * w_ent).sum()).backward()
    want = [hidden.grad] + [p.grad for p in head.parameters()]
    torch.testing.assert_close(lp.double(), want_lp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), want_ent.detach(), atol=1e-5, rtol=1e-5)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_fused_lm_head_without_entropy_returns_none_and_only_logprob_gradient():
    torch.manual_seed(3)
    head = torch.nn.Linear(8, 64, bias=False)
    hidden = torch.randn(10, 8, requires_grad=True)
    targets = torch.randint(0, 64, (10,))
    lp, ent = lm_head_token_logprobs(hidden, head, targets, with_entropy=False, chunk_rows=4)
    assert ent is None
    lp.sum().backward()
    want_lp, _ = reference(head(hidden), targets, 1.0)
    torch.testing.assert_close(lp.double(), want_lp.detach(), atol=1e-5, rtol=1e-5)
    assert hidden.grad is not None and head.weight.grad.abs().sum() > 0


def test_fused_lm_head_under_bf16_autocast_is_close_to_fp32():
    torch.manual_seed(4)
    head = torch.nn.Linear(32, 128, bias=False)
    hidden = torch.randn(12, 32, requires_grad=True)
    targets = torch.randint(0, 128, (12,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = lm_head_token_logprobs(hidden, head, targets)
    assert lp.dtype == torch.float32
    lp.sum().backward()
    assert head.weight.grad.dtype == torch.float32
    want_lp, _ = reference(head(hidden), targets, 1.0)
    torch.testing.assert_close(lp.double(), want_lp.detach(), atol=0.1, rtol=0.05)
