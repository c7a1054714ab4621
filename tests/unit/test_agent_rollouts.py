"""Agent groups: episodes → rollouts on exact ids, stop-reason policy, metrics; trainer masks."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncgrpo.base.config import AdvantageConfig, ConfigError, build_config
from asyncgrpo.base.episode import BranchSequence, EpisodeMetrics, StopReason
from asyncgrpo.learning.agents.runner import EpisodeOutcome
from asyncgrpo.learning.coordinator.buffer import RolloutBuffer
from asyncgrpo.learning.rollout.episodes import (
    EpisodeGroupBuilder,
    EpisodeSettings,
    GroupDropped,
    load_rollout,
)
from asyncgrpo.learning.rollout.orchestrator import Orchestrator
from asyncgrpo.learning.rollout.types import Group, Rollout
from asyncgrpo.learning.trainer.grpo_loss import sampled_mask


def two_turn_sample(base: int, version: int = 3) -> BranchSequence:
    """prompt (3) | sampled (2) | tool result (2) | sampled (2)."""
    ids = [1, 2, 3, base, base + 1, 90, 91, base + 2, base + 3]
    mask = [0, 0, 0, 1, 1, 0, 0, 1, 1]
    return BranchSequence(
        input_ids=ids,
        loss_mask=mask,
        logprobs=[-0.5 if m else 0.0 for m in mask],
        versions=[version if m else -1 for m in mask],
        branch_index=0,
    )


def outcome(reward, reason=StopReason.OK, samples=None, **metrics) -> EpisodeOutcome:
    samples = [two_turn_sample(10)] if samples is None else samples
    m = EpisodeMetrics(turns=2, tool_calls=1, branches=len(samples), **metrics)
    return EpisodeOutcome(reward, reason, samples, m)


class FakeRun:
    """Stands in for `run_episode`: hands out scripted outcomes in call order."""

    def __init__(self, outcomes):
        self.outcomes = list(outcomes)
        self.calls = 0

    async def __call__(self, client, rollout_fn, task, **kwargs):
        self.calls += 1
        assert kwargs["max_turns"] == 4 and kwargs["failure_rewards"] == {"timeout": 0.0}
        await asyncio.sleep(0)
        return self.outcomes.pop(0)


def builder(outcomes, num_generations=3, retries=1) -> tuple[EpisodeGroupBuilder, FakeRun]:
    run = FakeRun(outcomes)
    settings = EpisodeSettings(
        num_generations,
        max_turns=4,
        max_infra_retries=retries,
        failure_rewards={"timeout": 0.0},
        retry_delay_s=0.0,
    )
    return EpisodeGroupBuilder(None, None, settings, decode=lambda ids: str(ids), run=run), run


def test_episode_samples_become_rollouts_on_their_exact_ids():
    b, _ = builder([outcome(1.0), outcome(0.0, samples=[two_turn_sample(20), two_turn_sample(30)])])
    b.settings.num_generations = 2
    group = asyncio.run(b.build(7, {"prompt": "x"}))
    assert group.group_id == 7
    assert [r.rewards for r in group.rollouts] == [[1.0], [0.0], [0.0]]  # every branch scored
    r = group.rollouts[0]
    assert r.prompt_ids == [1, 2, 3]
    assert r.completion_ids == [10, 11, 90, 91, 12, 13]
    assert r.completion_mask == [1, 1, 0, 0, 1, 1]
    assert r.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
    assert r.min_version == 3 and group.min_version == 3  # −1 (inserted tokens) ignored
    assert r.num_sampled == 4
    assert not group.zero_variance
    stats = b.stats.take()
    assert stats["episodes"] == 2 and stats["branches_per_episode"] == 1.5
    assert stats["turns_per_episode"] == 2 and stats["tool_calls_per_episode"] == 1
    assert stats["stop_reasons"] == {"ok": 2}
    assert b.stats.take()["episodes"] == 0  # taken once


def test_infra_error_is_rescheduled_then_drops_the_group():
    infra = outcome(None, StopReason.INFRA_ERROR, samples=[])
    b, run = builder([outcome(1.0), infra, outcome(0.0), outcome(0.5)])
    group = asyncio.run(b.build(0, {}))
    assert run.calls == 4 and len(group.rollouts) == 3
    assert b.stats.take()["episode_infra_retries"] == 1

    b, run = builder([outcome(1.0), infra, outcome(0.0), infra], retries=1)
    with pytest.raises(GroupDropped) as dropped:
        asyncio.run(b.build(0, {}))
    assert dropped.value.reason == "infra_error"
    assert b.stats.take()["stop_reasons"]["infra_error"] == 2


def test_untrainable_episodes_are_masked_out_and_too_few_drop_the_group():
    reward_error = outcome(None, StopReason.REWARD_ERROR, samples=[two_turn_sample(40)])
    b, _ = builder([outcome(1.0), reward_error, outcome(0.0)])
    group = asyncio.run(b.build(0, {}))
    assert [r.completion_ids[0] for r in group.rollouts] == [10, 10]
    assert all(r.rewards[0] is not None for r in group.rollouts)  # nothing scored 0 silently
    assert b.stats.take()["stop_reasons"] == {"ok": 2, "reward_error": 1}

    timeout = outcome(None, StopReason.TIMEOUT)
    b, _ = builder([outcome(1.0), reward_error, timeout])
    with pytest.raises(GroupDropped) as dropped:
        asyncio.run(b.build(0, {}))
    assert dropped.value.reason == "degenerate"


def test_equal_rewards_flag_zero_variance():
    b, _ = builder([outcome(1.0), outcome(1.0), outcome(None, StopReason.TIMEOUT)])
    assert asyncio.run(b.build(0, {})).zero_variance


def test_orchestrator_counts_a_dropped_agent_group_under_its_reason():
    async def drop(group_id, row):
        raise GroupDropped("infra_error")

    class Prompts:
        done_positions: list[int] = []

        def done(self, position):
            self.done_positions.append(position)

    class Dropping:
        generated_tokens = 0
        build = staticmethod(drop)

    prompts = Prompts()
    buffer = RolloutBuffer(1, 0, on_group_end=prompts.done)
    assert buffer.wait_admit(0.1)
    orch = Orchestrator(Dropping(), buffer, prompts)
    asyncio.run(orch._run_group(9, {}))
    assert orch.failures["infra_error"] == 1 and prompts.done_positions == [9]
    assert buffer.snapshot()["dropped"] == {"infra_error": 1}


def test_orchestrator_counts_sampled_tokens_of_agent_groups():
    buffer = RolloutBuffer(1, 0)
    assert buffer.wait_admit(0.1)
    b, _ = builder([outcome(1.0), outcome(0.0)], num_generations=2)
    orch = Orchestrator(b, buffer, prompts=None)
    asyncio.run(orch._run_group(0, {}))
    assert orch.generated_tokens == 8  # sampled only, tool tokens excluded
    assert len(buffer.get_batch(0, timeout=1)[0].rollouts) == 2


def test_sampled_mask_pads_and_defaults_to_ones():
    plain = Rollout([1], [5, 6, 7], [0.0] * 3, [0] * 3, "stop", "")
    agent = Rollout([1], [5, 6], [0.0] * 2, [0, -1], "stop", "", completion_mask=[1, 0])
    mask = sampled_mask([plain, agent], 4)  # (B, T)
    assert mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert agent.min_version == 0 and plain.num_sampled == 3


def test_trainer_ignores_inserted_tokens():
    """Changing the tokens and log-probs at mask-0 positions changes neither loss nor gradient."""
    from asyncgrpo.base.config import AdvantageConfig, LossConfig, TrainerConfig
    from asyncgrpo.learning.trainer.policy_trainer import PolicyTrainer
    from asyncgrpo.testing import build_tiny_llama

    def run(inserted_logprob: float) -> tuple[float, torch.Tensor]:
        model = build_tiny_llama(64, seed=1)
        trainer = PolicyTrainer(
            model,
            TrainerConfig(bf16_autocast=False),
            LossConfig(),
            AdvantageConfig(),
            max_steps=100,
        )
        mask = [1, 1, 0, 0, 1]
        rollouts = [
            Rollout(
                [1, 2],
                [3, 4, 5, 6, 7 + i],
                [-1.0 if m else inserted_logprob for m in mask],
                [0 if m else -1 for m in mask],
                "stop",
                "",
                rewards=[float(i)],
                completion_mask=mask,
            )
            for i in range(2)
        ]
        metrics = trainer.step([Group(0, {}, rollouts)])
        return metrics["loss"], model.model.embed_tokens.weight.detach().clone()

    loss_a, weights_a = run(0.0)
    loss_b, weights_b = run(-30.0)  # would blow up a token correction if it were seen
    assert loss_a == pytest.approx(loss_b, abs=1e-7)
    assert torch.equal(weights_a, weights_b)


def test_agent_config_section_and_rollout_loading(tmp_path, monkeypatch):
    cfg = build_config({"agent": {"rollout": "json:loads", "max_turns": 3}})
    assert cfg.agent.max_turns == 3 and cfg.agent.max_infra_retries == 2
    with pytest.raises(ConfigError, match="agent.failure_rewards"):
        build_config({"agent": {"failure_rewards": {"reward_error": 0.0}}})
    with pytest.raises(ConfigError, match="agent.rollout"):
        build_config({"agent": {"rollout": "no_colon"}})
    with pytest.raises(ValueError, match="async def"):
        load_rollout("json:loads")
    (tmp_path / "my_agent.py").write_text("async def rollout(task, llm):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)  # found from the working directory, like `python -m`
    assert load_rollout("my_agent:rollout").__name__ == "rollout"


def test_reward_functions_grade_the_final_reply_as_metrics_only():
    from asyncgrpo.learning.rollout.episodes import final_reply_ids
    from asyncgrpo.learning.rollout.rewards import RewardRunner

    assert final_reply_ids(outcome(1.0)) == [12, 13]

    def ends_in_13(prompts, completions, completion_ids, **columns):
        return [1.0 if ids[-1] == 13 else 0.0 for ids in completion_ids]

    graders = RewardRunner([ends_in_13])
    b, _ = builder([outcome(1.0), outcome(0.0)], num_generations=2)
    b.graders = graders
    group = asyncio.run(b.build(0, {"prompt": "x"}))
    assert [r.rewards for r in group.rollouts] == [[1.0], [0.0]]  # the rollout's reward
    assert b.stats.take()["final_ends_in_13"] == 1.0
    graders.close()


def test_calculator_tool_evaluates_arithmetic_and_refuses_everything_else():
    from asyncgrpo.learning.agents.tools import ToolBox
    from asyncgrpo.learning.tasks.calculator import calculator, calculator_rows, contains_answer

    assert calculator("347 * 58") == "20126" and calculator("(1 + 2) / 4") == "0.75"
    assert calculator("-3 + 10 / 2") == "2"
    for bad in ['__import__("os")', "2 ** 100", "a + 1", "1 / 0", "[1, 2]", "9" * 20, "1" * 300]:
        with pytest.raises(ValueError):
            calculator(bad)
    box = ToolBox([calculator])  # through the tool box the model's mistakes are text, counted
    call = {"function": {"name": "calculator", "arguments": '{"expression": "open(1)"}'}}
    assert asyncio.run(box.call(call)).startswith("Error: calculator raised ValueError")
    assert box.errors == {"exception": 1}
    for row in calculator_rows(20, 0, kind="mixed"):
        a = row["expression"]
        assert row["answer"] == calculator(a) and a in row["prompt"][0]["content"]
    assert contains_answer("so 347 * 58 = 20,126.", "20126")
    assert not contains_answer("347 * 58 = 20125", "20126")


class TwoColumnScorer:
    """Scores from each episode's context: (context, 2 * context), None for context None."""

    names = ["base", "double"]

    def __init__(self):
        self.seen = []

    async def score(self, row, outcomes):
        self.seen.append([o.context for o in outcomes])
        return [[o.context, None if o.context is None else 2 * o.context] for o in outcomes]


def test_a_group_scorer_gives_every_scorable_episode_its_reward_columns():
    scripted = [outcome(None), outcome(None), outcome(None, StopReason.TIMEOUT)]
    for value, o in zip([1.0, 3.0, 5.0], scripted, strict=True):
        o.context = value
    b, _ = builder(scripted)
    b.scorer = b.rewards = TwoColumnScorer()
    b.advantage = AdvantageConfig(reward_weights=[1.0, 0.5])
    group = asyncio.run(b.build(1, {"prompt": "x"}))
    assert b.scorer.seen == [[1.0, 3.0]]  # a timed-out episode is not scored
    assert [r.rewards for r in group.rollouts] == [[1.0, 2.0], [3.0, 6.0]]
    assert b.rewards.names == ["base", "double"]


def test_a_raising_group_scorer_drops_the_group_as_a_reward_error():
    class Broken:
        names = ["r"]

        async def score(self, row, outcomes):
            raise KeyError("answer")

    b, _ = builder([outcome(None), outcome(None), outcome(None)])
    b.scorer = Broken()
    with pytest.raises(GroupDropped) as dropped:
        asyncio.run(b.build(1, {"prompt": "x"}))
    assert dropped.value.reason == "reward_error" and "answer" in str(dropped.value)


def test_agent_sources_are_exclusive_and_sections_validate():
    cfg = build_config({"agent": {"verifiers": {"id": "reverse-text", "args": {"n": 3}}}})
    assert cfg.agent.source == "verifiers" and cfg.agent.verifiers.args == {"n": 3}
    with pytest.raises(ConfigError, match="one episode source"):
        build_config({"agent": {"rollout": "m:f", "environment": "m:Env"}})
    with pytest.raises(ConfigError, match="exactly one of"):
        build_config({"agent": {"openenv": {}}})
    with pytest.raises(ConfigError, match="package.module:Class"):
        build_config({"agent": {"environment": "EnvWithoutModule"}})
