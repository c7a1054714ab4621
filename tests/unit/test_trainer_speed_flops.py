"""The trainer benchmark's FLOP count (`benchmarks/trainer_speed.py`), against a case
counted by hand, and its padded TRL-style step against a plain per-sequence loop."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from asyncgrpo.learning.rollout.types import Group, Rollout

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def speed(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("trainer_speed")


def rollout(prompt: list[int], completion: list[int], reward: float) -> Rollout:
    n = len(completion)
    return Rollout(prompt, completion, [0.0] * n, [0] * n, "stop", "", [reward])


def test_minimal_flops_counts_a_shared_prompt_once(speed):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(speed.model_config("tiny"))
    group = Group(0, {}, [rollout([1, 2, 3], [4, 5], 1.0), rollout([1, 2, 3], [6, 7, 8], 0.0)])
    # by hand, for hidden 64, intermediate 128, 4 heads of 16, 2 KV heads, 2 layers, vocab 512:
    # linear weights per layer q 64x64, k and v 64x32, o 64x64, gate/up/down 64x128 -> 36864
    body, head = 2 * 36864, 512 * 64
    inputs = 3 + (2 - 1) + (3 - 1)  # the prompt once; a completion's last token is no input
    head_rows = 2 + 3  # one per completion token
    pairs = (1 + 2 + 3) + (4) + (4 + 5)  # causal (query, key) pairs of the shared layout
    expected = 6 * body * inputs + 6 * head * head_rows + 12 * 2 * 64 * pairs
    assert speed.minimal_flops(model, [group]) == expected


def test_padded_step_loss_is_the_token_mean_policy_gradient(speed):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(speed.model_config("tiny"), dtype=torch.float32)
    groups = [
        Group(0, {}, [rollout([1, 2, 3], [4, 5], 1.0), rollout([1, 2, 3], [6, 7, 8], 0.0)]),
        Group(1, {}, [rollout([9, 10], [11], 0.0), rollout([9, 10], [12, 13, 14, 15], 1.0)]),
    ]
    padded = speed.PaddedTrainer(model, torch.device("cpu"), False, sequences_per_micro=2)
    advantages = speed.group_advantages(groups)
    assert advantages[0][0] > 0 > advantages[0][1]  # the better reply gets the positive advantage
    seqs = [
        (r.prompt_ids, r.completion_ids, a)
        for g, advs in zip(groups, advantages, strict=True)
        for r, a in zip(g.rollouts, advs, strict=True)
    ]
    total = sum(len(c) for _, c, _ in seqs)
    padded._micro_loss(seqs[:2], total).backward()  # one micro-batch: group 0, padded
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for prompt, completion, adv in seqs[:2]:  # the plain loop: one sequence at a time
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0]
        rows = logits[len(prompt) - 1 : -1]  # the rows that predict the completion
        logprobs = torch.log_softmax(rows, -1)[torch.arange(len(completion)), completion]
        (-(adv * torch.exp(logprobs - logprobs.detach())).sum() / total).backward()
    for mine, reference in zip(got, (p.grad for p in model.parameters()), strict=True):
        assert torch.allclose(mine, reference, atol=1e-6)
    assert any(g.abs().max() > 1e-4 for g in got), "the test would not notice a wrong gradient"


def test_generation_flops_prefill_a_prompt_once_and_decode_each_sample(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    ceiling = importlib.import_module("ceiling")
    speed = importlib.import_module("trainer_speed")
    config = speed.model_config("tiny")  # the sizes counted by hand in the test above
    body, head, attend = 2 * 36864, 512 * 64, 4 * 2 * 64
    # a 3-token prompt, 2 samples of 2 tokens: the prefill (3 inputs, 1+2+3 pairs) yields
    # each sample's first token; its second comes from one decode input seeing 4 keys
    prefill = 2 * body * 3 + attend * 6
    sample = 2 * body * 1 + 2 * head * 2 + attend * 4
    assert ceiling.generation_flops(config, [3], 2, 2.0) == prefill + 2 * sample
    assert ceiling.linear_weights(config) == (body, head)
