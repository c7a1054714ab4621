"""The trainer's AdamW (fused where possible) against AdamW written out by hand."""

from __future__ import annotations

import math

import torch

from asyncgrpo.trainer.policy_trainer import make_adamw


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
