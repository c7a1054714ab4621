"""The trainer's per-step metrics that come from the batch itself (`trainer/policy_trainer.py`).

Per-token staleness: every sampled token is aged by the version that sampled it, so a
completion that a weight sync split mid-generation counts each part at its own version.
The expected values are worked out by hand in the comments.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from asyncgrpo.base.config import AdvantageConfig, LossConfig, TrainerConfig
from asyncgrpo.learning.rollout.types import Group, Rollout
from asyncgrpo.learning.trainer.policy_trainer import PolicyTrainer, batch_metrics
from asyncgrpo.testing import build_tiny_llama


def split_batch() -> list[Rollout]:
    # a completion split by a sync after its second token (versions 3 then 4), its second
    # token masked out; an agent sample whose only sampled token is its last (the 2 under
    # mask 0 and the inserted -1 must not count)
    split = Rollout(
        [1, 2],
        [3, 4, 5, 6, 7],
        [-1.0] * 5,
        [3, 3, 4, 4, 4],
        "length",
        "",
        rewards=[1.0],
        completion_mask=[1, 0, 1, 1, 1],
    )
    agent = Rollout(
        [1, 2],
        [8, 9, 10],
        [-1.0, 0.0, -1.0],
        [2, -1, 4],
        "stop",
        "",
        rewards=[0.0],
        completion_mask=[0, 0, 1],
    )
    return [split, agent]


def test_token_staleness_counts_sampled_tokens_at_their_own_version():
    # trainer at 5: ages 5-3, 5-4, 5-4, 5-4 (split) and 5-4 (agent) = [2, 1, 1, 1, 1]
    metrics = batch_metrics(split_batch(), np.zeros(2), trainer_version=5)
    assert metrics["token_staleness_mean"] == pytest.approx(6 / 5)
    assert metrics["token_staleness_max"] == 2
    fresh = batch_metrics(split_batch(), np.zeros(2), trainer_version=4)  # [1, 0, 0, 0, 0]
    assert fresh["token_staleness_mean"] == pytest.approx(1 / 5)
    assert fresh["token_staleness_max"] == 1


def test_token_staleness_is_nan_without_sampled_tokens():
    inserted = Rollout([1], [2, 3], [0.0, 0.0], [-1, -1], "stop", "", completion_mask=[0, 0])
    unversioned = Rollout([1], [2], [-1.0], [], "stop", "")  # as `Prepared.from_message`
    metrics = batch_metrics([inserted, unversioned], np.zeros(2), trainer_version=3)
    assert math.isnan(metrics["token_staleness_mean"])
    assert math.isnan(metrics["token_staleness_max"])


def test_a_step_reports_staleness_against_the_version_it_began_at():
    trainer = PolicyTrainer(
        build_tiny_llama(64, seed=1),
        TrainerConfig(bf16_autocast=False),
        LossConfig(),
        AdvantageConfig(),
        max_steps=10,
    )
    trainer.version = 5
    metrics = trainer.step([Group(0, {}, split_batch())])
    assert trainer.version == 6
    assert metrics["token_staleness_mean"] == pytest.approx(6 / 5)
    assert metrics["token_staleness_max"] == 2
