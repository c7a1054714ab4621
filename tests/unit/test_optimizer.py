"""The trainer's AdamW (fused where possible) against AdamW written out by hand."""

from __future__ import annotations

import math

import torch

from asyncgrpo.learning.trainer.optimizer import clipped_step, make_adamw


def test_adamw_matches_the_decoupled_weight_decay_update_written_out():
    lr, wd, b1, b2, eps = 0.1, 0.01, 0.9, 0.999, 1e-8
    start = [0.5, -1.0, 2.0]
    grads = [[0.3, -0.2, 0.0], [-0.1, 0.4, 1.5]]
    param = torch.nn.Parameter(torch.tensor(start))
    optimizer = make_adamw([param], lr=lr, weight_decay=wd)
    for g in grads:
        param.grad = torch.tensor(g)
        optimizer.step()

    expected = []
    for i, p in enumerate(start):
        m = v = 0.0
        for t, g in enumerate(grads, start=1):
            p -= lr * wd * p  # decoupled decay first
            m = b1 * m + (1 - b1) * g[i]
            v = b2 * v + (1 - b2) * g[i] ** 2
            m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
            p -= lr * m_hat / (math.sqrt(v_hat) + eps)
        expected.append(p)
    torch.testing.assert_close(param.detach(), torch.tensor(expected), rtol=1e-6, atol=1e-6)


def test_fused_kernel_is_used_for_float32_cpu_parameters():
    optimizer = make_adamw([torch.nn.Parameter(torch.zeros(4))], lr=1e-3)
    assert optimizer.param_groups[0]["fused"] is True


def _two_params(grads: list[list[float]]) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0])[: len(g)]) for g in grads]
    for param, g in zip(params, grads):
        param.grad = torch.tensor(g)
    return params


def test_a_clipped_fused_step_is_the_step_on_gradients_scaled_to_the_norm_by_hand(monkeypatch):
    grads = [[3.0, -4.0], [12.0]]  # global norm 13
    params = _two_params(grads)
    # eps as large as the gradients: Adam's first step is otherwise blind to their scale
    optimizer = make_adamw(params, lr=0.1, weight_decay=0.01, eps=1.0)

    def no_separate_pass(*args, **kwargs):
        raise AssertionError("the fused kernel scales the gradients itself")

    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", no_separate_pass)
    norm = clipped_step(optimizer, params, max_norm=2.0)
    assert float(norm) == 13.0
    assert not hasattr(optimizer, "grad_scale")

    scale = 2.0 / (13.0 + 1e-6)
    reference = _two_params([[g * scale for g in row] for row in grads])
    plain = torch.optim.AdamW(reference, lr=0.1, weight_decay=0.01, eps=1.0, foreach=False)
    plain.step()
    for param, expected in zip(params, reference):
        torch.testing.assert_close(param.detach(), expected.detach(), rtol=1e-6, atol=1e-7)


def test_an_unclipped_fused_step_is_bitwise_the_plain_fused_step():
    grads = [[0.3, -0.2], [0.1]]
    params, reference = _two_params(grads), _two_params(grads)
    clipped_step(make_adamw(params, lr=0.1), params, max_norm=1.0)
    make_adamw(reference, lr=0.1).step()
    assert all(torch.equal(p, r) for p, r in zip(params, reference))


def test_the_multi_tensor_kernel_and_no_clipping_take_the_plain_paths():
    grads = [[3.0, -4.0], [12.0]]
    params = _two_params(grads)
    optimizer = torch.optim.AdamW(params, lr=0.1, foreach=True)
    clipped_step(optimizer, params, max_norm=2.0)
    assert math.isclose(math.hypot(*(float(v) for p in params for v in p.grad)), 2.0, rel_tol=1e-5)
    unclipped = _two_params(grads)
    norm = clipped_step(make_adamw(unclipped, lr=0.1), unclipped, max_norm=0.0)
    assert float(norm) == 13.0 and unclipped[1].grad.tolist() == [12.0]
