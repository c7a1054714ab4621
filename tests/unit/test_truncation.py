"""TRL's two truncation options: `loss.mask_truncated_completions` (completions cut off by
the length limit count in their group's advantages but carry no loss) and
`rollout.max_prompt_length` (TRL < 1.0's left truncation of the prompt's token ids).
The expected values are worked out by hand in the comments."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from asyncgrpo.base.config import AdvantageConfig, LossConfig, TrainerConfig, build_config
from asyncgrpo.inference.client.engine_client import Completion, Continuation
from asyncgrpo.learning.rollout.single_turn import SamplingSettings, SingleTurnBuilder
from asyncgrpo.learning.rollout.types import Group, Rollout
from asyncgrpo.learning.trainer.policy_trainer import PolicyTrainer
from asyncgrpo.run.roles import group_builder as _builder
from asyncgrpo.testing import build_tiny_llama

# ---- mask_truncated_completions ------------------------------------------------------


def group(truncated_ids: list[int]) -> Group:
    """A: stopped, 2 tokens, reward 1; B: cut off by the length limit, reward 0; C: stopped,
    1 token, reward 0."""
    a = Rollout([1, 2], [3, 4], [-1.0, -1.2], [0, 0], "stop", "a", rewards=[1.0])
    n = len(truncated_ids)
    b = Rollout([1, 2], truncated_ids, [-0.7] * n, [0] * n, "length", "b", rewards=[0.0])
    c = Rollout([1, 2], [9], [-0.9], [0], "stop", "c", rewards=[0.0])
    return Group(0, {}, [a, b, c])


def trainer(mask: bool, aggregation: str = "dapo") -> PolicyTrainer:
    return PolicyTrainer(
        build_tiny_llama(64, seed=1),
        TrainerConfig(bf16_autocast=False),
        LossConfig(mask_truncated_completions=mask, aggregation=aggregation),
        AdvantageConfig(),
        max_steps=10,
    )


def test_a_truncated_completion_counts_in_the_advantages_but_not_in_the_loss_counts():
    g = group([5, 6, 7])
    batch = trainer(mask=True).prepare([g])
    # rewards [1, 0, 0]: mean 1/3, sample std sqrt((4/9 + 1/9 + 1/9) / 2) = 1/sqrt(3), so
    # A's advantage is (2/3) / (1/sqrt(3) + 1e-4) and B's, C's -(1/3) / (...) (B included:
    # without it A's would be 0.5 / (1/sqrt(2) + 1e-4) = 0.707)
    std = 1 / 3**0.5 + 1e-4
    expected = [(2 / 3) / std, -(1 / 3) / std, -(1 / 3) / std]
    assert batch.advantages.tolist() == pytest.approx(expected)
    # loss tokens: A's 2 + C's 1; sequences: A and C
    assert batch.counts["num_global_tokens"] == batch.counts["num_batch_tokens"] == 3.0
    assert batch.counts["num_global_sequences"] == 2.0
    assert [r.completion_mask for r in batch.rollouts] == [None, [0, 0, 0], None]
    # the group's own rollouts are untouched (samples.jsonl, metrics), rewards carried over
    assert [r.completion_mask for r in g.rollouts] == [None, None, None]
    assert [r.reward for r in batch.rollouts] == [1.0, 0.0, 0.0]
    off = trainer(mask=False).prepare([group([5, 6, 7])])
    assert off.counts["num_global_tokens"] == 6.0 and off.counts["num_global_sequences"] == 3.0
    assert off.advantages.tolist() == pytest.approx(batch.advantages.tolist())


def test_a_truncated_completion_still_counts_in_the_completion_length():
    # A's 2 tokens, B's 3 (cut off, no loss), C's 1: (2 + 3 + 1) / 3 = 2 either way
    for mask in (True, False):
        t = trainer(mask)
        metrics = t.step([group([5, 6, 7])])
        assert metrics["completion_len_mean"] == pytest.approx(2.0), mask


def gradients(mask: bool, truncated_ids: list[int], aggregation: str) -> tuple[dict, float]:
    """The gradients of one step's loss (no optimizer step) and its loss tokens."""
    t = trainer(mask, aggregation)
    totals = t.accumulate(t.prepare([group(truncated_ids)]))
    grads = {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}
    return grads, totals.tokens


@pytest.mark.parametrize("aggregation", ["dapo", "grpo"])
def test_a_truncated_completions_tokens_get_no_gradient(aggregation):
    # B's tokens carry no loss: the step's gradient is the same whatever B sampled
    first, tokens = gradients(True, [5, 6, 7], aggregation)
    other, _ = gradients(True, [40, 41, 42, 43], aggregation)
    assert tokens == 3.0
    torch.testing.assert_close(first, other)
    # without the option B trains, and what it sampled changes the gradient
    trained, tokens = gradients(False, [5, 6, 7], aggregation)
    changed, _ = gradients(False, [40, 41, 42, 43], aggregation)
    assert tokens == 6.0
    assert any(not torch.allclose(trained[n], changed[n]) for n in trained)


# ---- max_prompt_length ---------------------------------------------------------------


class CharTokenizer:
    """One id per character of a plain-string prompt."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [100 + ord(c) for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(str(i) for i in ids)


class RecordingClient:
    """Every call: `n` finished two-token samples; records the prompt ids it was sent."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    async def complete(self, prompt_ids, *, n=1, max_tokens=16, **sampling) -> Completion:
        self.prompts.append(list(prompt_ids))
        samples = [Continuation([7, 8 + i], [-0.1, -0.2], [0, 0], "stop") for i in range(n)]
        return Completion(samples, list(prompt_ids))


class IndexRewards:
    names = ["index"]

    async def score_group(self, row, texts, ids) -> list[list[float]]:
        return [[float(i) for i in range(len(texts))]]


def builder(max_prompt_length: int | None) -> tuple[SingleTurnBuilder, RecordingClient]:
    client = RecordingClient()
    sampling = SamplingSettings(
        n=2, max_tokens=4, temperature=1.0, max_prompt_length=max_prompt_length
    )
    rewards = IndexRewards()
    return SingleTurnBuilder(client, CharTokenizer(), rewards, sampling, AdvantageConfig()), client


@pytest.mark.parametrize(("limit", "kept"), [(4, "cdef"), (6, "abcdef"), (None, "abcdef")])
def test_max_prompt_length_keeps_the_end_of_the_prompt(limit, kept):
    b, client = builder(limit)
    g = asyncio.run(b.build(0, {"prompt": "abcdef"}))
    expected = [100 + ord(c) for c in kept]
    assert client.prompts == [expected]  # what the engine was asked
    assert all(r.prompt_ids == expected for r in g.rollouts)  # what the trainer trains on
    asyncio.run(b.evaluate([{"prompt": "abcdef"}]))  # held-out prompts the same way
    assert client.prompts[-1] == expected


def test_max_prompt_length_reaches_the_builder_by_its_trl_name(caplog):
    cfg = build_config({"max_prompt_length": 4})
    assert cfg.rollout.max_prompt_length == 4
    b = _builder(cfg, RecordingClient(), CharTokenizer(), IndexRewards(), None)
    assert b.sampling.max_prompt_length == 4

    async def episode(task, llm):
        return 0.0

    with caplog.at_level(logging.WARNING, logger="asyncgrpo.run.roles"):
        _builder(cfg, RecordingClient(), CharTokenizer(), IndexRewards(), episode)
    assert "agent episodes ignore it" in caplog.text  # ignored there, and said so
