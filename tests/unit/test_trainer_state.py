"""Reward functions get TRL's `trainer_state` when they ask for it.

- A function that names `trainer_state`, or takes `**kwargs`, receives a
  `TrainerState` with `global_step`, `max_steps` and `epoch`; one that takes
  neither keeps working without it (thread and process workers alike).
- Over a run of the real loop (fake engine, builder and trainer, real
  orchestrator and buffer), the step a reward function sees advances with
  training, `max_steps` is the run's, and `epoch` counts passes over the prompts.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from test_roles import FakeBuilder, assemble, run_config, train_like_run_train

from asyncgrpo.learning.rollout.rewards import RewardRunner, TrainerState, takes_trainer_state


def explicit_state_reward(prompts, completions, completion_ids, trainer_state):
    return [float(trainer_state.global_step)] * len(completions)


def kwargs_state_reward(prompts, completions, **kwargs):
    state = kwargs["trainer_state"]
    return [float(state.max_steps)] * len(completions)


def stateless_reward(prompts, completions, completion_ids):
    return [1.0] * len(completions)


def test_only_functions_that_accept_it_take_trainer_state():
    assert takes_trainer_state(explicit_state_reward)
    assert takes_trainer_state(kwargs_state_reward)
    assert not takes_trainer_state(stateless_reward)


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_reward_functions_see_the_published_trainer_state(workers):
    runner = RewardRunner(
        [explicit_state_reward, kwargs_state_reward, stateless_reward], workers=workers
    )
    try:
        runner.trainer_state = TrainerState(global_step=7, max_steps=20, epoch=1.5)
        scores = asyncio.run(runner.score_group({"prompt": "p"}, ["a", "b"], [[1], [2]]))
    finally:
        runner.close()
    assert scores == [[7.0, 7.0], [20.0, 20.0], [1.0, 1.0]]


def test_the_step_a_reward_sees_advances_with_training(tmp_path):
    seen: list[TrainerState] = []
    lock = threading.Lock()

    def progress_reward(prompts, completions, trainer_state, **kwargs):
        with lock:
            seen.append(trainer_state)
        return [float(i) for i in range(len(completions))]  # distinct: never zero variance

    rewards = RewardRunner([progress_reward])

    class ScoringBuilder(FakeBuilder):
        async def build(self, group_id, row):
            group = await super().build(group_id, row)
            texts = [r.text for r in group.rollouts]
            await rewards.score_group(row, texts, [r.completion_ids for r in group.rollouts])
            return group

    cfg = run_config(tmp_path)  # max_steps 4, 2 groups a batch, max_staleness 1
    rows = [{"prompt": f"p{i}"} for i in range(3)]
    r = assemble(cfg, rows, builder=ScoringBuilder, rewards=rewards)
    train_like_run_train(r)

    steps = sorted({s.global_step for s in seen})
    assert steps[0] == 0 and steps[-1] >= cfg.max_steps - 2, steps
    assert len(steps) >= 3, f"the step did not advance as training went on: {steps}"
    assert {s.max_steps for s in seen} == {cfg.max_steps}
    epochs = [s.epoch for s in seen]
    assert epochs[0] == 0.0 and max(epochs) >= 2.0, epochs  # 4 steps x 2 groups over 3 rows
