"""Chunked and fused log-probs / entropy agree with a plain full log-softmax, gradients included."""

import pytest
import torch

from asyncgrpo.learning.trainer import logprobs as logprobs_module
from asyncgrpo.learning.trainer.logprobs import (
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


@pytest.mark.parametrize("buffer_rows", [3, 8, 64])  # below a chunk, two chunks, all rows
def test_bf16_head_weight_gradient_matches_a_float64_loop(buffer_rows, monkeypatch):
    """The bf16 head gathers chunks' logit gradients into buffers of `buffer_rows` rows
    (a buffer never holds less than a chunk) and returns a float32 weight gradient."""
    monkeypatch.setattr(logprobs_module, "HEAD_GRAD_BUFFER_BYTES", buffer_rows * 128 * 2)
    torch.manual_seed(5)
    head = torch.nn.Linear(32, 128, bias=False)
    hidden = torch.randn(13, 32)
    targets = torch.randint(0, 128, (13,))
    weights = torch.rand(13)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = lm_head_token_logprobs(hidden, head, targets, chunk_rows=4)
    (lp * weights).sum().backward()
    assert head.weight.grad.dtype == torch.float32
    w = head.weight.detach().bfloat16().double().requires_grad_()
    total = 0.0
    for row, target, weight in zip(hidden.bfloat16().double(), targets, weights.double()):
        total = total + torch.log_softmax(w @ row, dim=-1)[target] * weight
    total.backward()
    scale = w.grad.abs().max().item()
    torch.testing.assert_close(head.weight.grad.double(), w.grad, atol=0.01 * scale, rtol=0.02)


@pytest.mark.parametrize("bf16", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kept_logits_give_the_recomputed_gradients_exactly(temperature, bf16, monkeypatch):
    """The backward reads the forward's logits (bf16 or float32) instead of recomputing
    them: the same numbers, so the same gradients to the bit, with or without a bias and
    entropy, and a second backward over a retained graph gives them again."""
    torch.manual_seed(6)
    head = torch.nn.Linear(32, 128, bias=True)
    hidden = torch.randn(13, 32)
    targets = torch.randint(0, 128, (13,))
    grads = []
    for kept_bytes in (0, 1 << 30):
        monkeypatch.setattr(logprobs_module, "KEPT_LOGITS_BYTES", kept_bytes)
        head.zero_grad()
        h = hidden.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            lp, ent = lm_head_token_logprobs(
                h, head, targets, temperature, with_entropy=True, chunk_rows=4
            )
        (lp.sum() + 0.1 * ent.sum()).backward(retain_graph=True)
        grads.append((lp, ent, h.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()))
        h.grad, head.weight.grad, head.bias.grad = None, None, None
        (lp.sum() + 0.1 * ent.sum()).backward()
        grads.append((lp, ent, h.grad, head.weight.grad, head.bias.grad))
    for recomputed, kept, kept_again in zip(grads[0], grads[2], grads[3], strict=True):
        assert torch.equal(recomputed, kept)
        assert torch.equal(kept, kept_again)


# ---- top_p < 1: log-probs of the truncated, renormalised distribution the engine samples --


def identity_head(vocab: int) -> torch.nn.Linear:
    """A head whose logits are its input rows exactly, to feed chosen logits to the fused path."""
    head = torch.nn.Linear(vocab, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(vocab))
    return head


def test_top_p_logprobs_match_a_hand_computed_nucleus():
    # softmax([2, 1, 0, -1]) = [0.644, 0.237, 0.087, 0.032]; mass before each token:
    # [0, 0.644, 0.881, 0.968], so top_p=0.8 keeps tokens 0 and 1. A sampled token
    # outside the trainer's nucleus (2) joins the support instead of getting -inf.
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 3)
    targets = torch.tensor([0, 1, 2])
    lp, ent = lm_head_token_logprobs(
        logits, identity_head(4), targets, with_entropy=True, top_p=0.8
    )
    # support {0, 1}: log p = z - log(e^2 + e^1); support {0, 1, 2}: z - log(e^2 + e^1 + e^0)
    torch.testing.assert_close(lp, torch.tensor([-0.3132617, -1.3132617, -2.4076060]))
    torch.testing.assert_close(ent, torch.tensor([0.5822031, 0.5822031, 0.8323956]))


def nucleus_reference(logits, targets, temperature, top_p):
    """Plain loops: the engine's rule (keep while the mass before < top_p), plus the target;
    log-probs and entropies (float64, differentiable) on that support."""
    z = logits.double() / temperature  # (N, V)
    picked, entropies = [], []
    for row, target in zip(z, targets.tolist(), strict=True):
        probs = torch.softmax(row.detach(), dim=-1).tolist()
        order = sorted(range(len(probs)), key=lambda i: -probs[i])
        support, mass = {target}, 0.0
        for i in order:
            if mass >= top_p:
                break
            support.add(i)
            mass += probs[i]
        keep = torch.tensor([i in support for i in range(len(probs))])
        logp = torch.log_softmax(row.masked_fill(~keep, float("-inf")), dim=-1)
        picked.append(logp[target])
        entropies.append(-(logp.exp()[keep] * logp[keep]).sum())
    return torch.stack(picked), torch.stack(entropies)


# the nucleus found in the top-k search alone, or (for rows where k is too few) by a sort
@pytest.mark.parametrize("first_k", [4, 40, 1024])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 0.9), (0.7, 0.5), (1.3, 0.95)])
def test_top_p_fused_head_matches_plain_loop_values_and_gradients(
    temperature, top_p, first_k, monkeypatch
):
    monkeypatch.setattr(logprobs_module, "NUCLEUS_FIRST_K", first_k)
    torch.manual_seed(5)
    head = torch.nn.Linear(16, 200, bias=False)
    with torch.no_grad():
        head.weight.mul_(3)
    hidden = torch.randn(33, 16, requires_grad=True)
    targets = torch.randint(0, 200, (33,))  # many lie outside the nucleus: the support grows
    w_lp, w_ent = torch.randn(33), torch.randn(33)

    lp, ent = lm_head_token_logprobs(
        hidden, head, targets, temperature, with_entropy=True, chunk_rows=5, top_p=top_p
    )
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    got = [hidden.grad.clone(), head.weight.grad.clone()]
    hidden.grad = None
    head.zero_grad()

    want_lp, want_ent = nucleus_reference(head(hidden), targets, temperature, top_p)
    ((want_lp * w_lp).sum() + (want_ent * w_ent).sum()).backward()
    torch.testing.assert_close(lp.double(), want_lp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), want_ent.detach(), atol=1e-5, rtol=1e-5)
    for g, w in zip(got, [hidden.grad, head.weight.grad], strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    full_lp, _ = reference(head(hidden), targets, temperature)
    assert (lp.double() - full_lp.detach()).min() > 1e-3, "truncation did not renormalise"


@pytest.mark.parametrize("first_k", [64, 1024])
def test_top_p_logprobs_equal_the_engine_samplers_processed_logprobs(first_k, monkeypatch):
    from asyncgrpo.inference.engine.sampling import RowParams, sample

    monkeypatch.setattr(logprobs_module, "NUCLEUS_FIRST_K", first_k)
    torch.manual_seed(6)
    logits = torch.randn(40, 300) * 3
    temperature, top_p = 0.7, 0.9
    generator = torch.Generator().manual_seed(0)
    rows = [RowParams(temperature, top_p, 0, generator, 0) for _ in range(40)]
    drawn = sample(logits, rows)
    tokens = torch.tensor(drawn.tokens)
    engine = torch.tensor(drawn.logprobs)

    head = identity_head(300)
    truncated, _ = lm_head_token_logprobs(logits, head, tokens, temperature, top_p=top_p)
    torch.testing.assert_close(truncated, engine, atol=1e-5, rtol=1e-5)
    # the full-vocabulary log-probs the trainer used before differ by the kept mass
    full, _ = lm_head_token_logprobs(logits, head, tokens, temperature)
    assert (truncated - full).min() > 1e-3
