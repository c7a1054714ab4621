"""verifiers 0.4 environments through the real pipeline (tiny models), unchanged: a tool
environment, a custom multi-turn `Env` and a single-turn taskset (`verifiers_v1_envs/`).

Checked against what the gateway recorded and what verifiers recorded (its traces): the
trained tokens are the engine's own, sampled ones, token for token; tool results and the
environment's user turn sit between the replies at loss 0; the reward columns are the
task's reward functions, by name, each the score verifiers gave, summed with the
environment's weights into verifiers' own `trace.reward`; an environment that raises
costs infra_error retries, never a reward; held-out tasks come from a second taskset.
"""

from __future__ import annotations

import pytest
from test_train import Recorder, base_config, flat, read_jsonl
from test_train_trl_environment import teach_tool_calls
from verifiers_v1_support import ENVS, importable, requires_verifiers_04

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.base.episode import StopReason
from asyncgrpo.learning.rollout import episodes as episodes_mod
from asyncgrpo.run.loop import train
from asyncgrpo.testing import save_tiny_model_dir

pytestmark = [requires_verifiers_04, pytest.mark.heavy]  # whole runs: engine, gateway, trainer


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    """The tiny model, taught to answer every turn with one `look` tool call."""
    model_dir = save_tiny_model_dir(tmp_path_factory.mktemp("tiny-tool-caller"))
    teach_tool_calls(model_dir)
    return model_dir


@pytest.fixture
def outcomes(monkeypatch):
    """Every episode's outcome, as the group builder saw it."""
    seen = []

    async def recording_run_episode(*args, **kwargs):
        outcome = await run_episode(*args, **kwargs)
        seen.append(outcome)
        return outcome

    run_episode = episodes_mod.run_episode
    monkeypatch.setattr(episodes_mod, "run_episode", recording_run_episode)
    return seen


def run(tmp_path, model_dir, name: str, verifiers: dict, front_door=False, **overrides):
    settings = {
        "engine.max_model_len": 256,
        "rollout.num_generations": 3,
        "rollout.max_tokens": 40,
        "agent.max_turns": 2,
        "agent.episode_timeout_s": 60,
        "agent.verifiers": verifiers,
        **overrides,
    }
    args = AsyncGRPOConfig(**flat(base_config(tmp_path, model_dir, name, max_steps=2, **settings)))
    if front_door:  # the Python API, as a TRL user calls it: no reward_funcs, no dataset
        return AsyncGRPOTrainer(model=str(model_dir), args=args).train()
    return train(args)


def trained(recorder, outcomes):
    """(rollout, its outcome, the gateway's sample) of every trained sequence."""
    counted = [o for o in outcomes if o.stop_reason != StopReason.INFRA_ERROR]
    by_sequence = {tuple(s.input_ids): (o, s) for o in counted for s in o.samples}
    for groups in recorder.batches:
        for group in groups:
            for r in group.rollouts:
                outcome, sample = by_sequence[tuple(r.prompt_ids + r.completion_ids)]
                assert [0] * len(r.prompt_ids) + r.completion_mask == sample.loss_mask
                masked = [i for i, m in enumerate(r.completion_mask) if not m]
                assert all(r.logprobs[i] == 0.0 and r.versions[i] == -1 for i in masked)
                yield r, outcome, sample


def test_a_tool_environment_trains_on_the_engines_tokens(
    tmp_path, tool_model_dir, monkeypatch, outcomes
):
    importable(monkeypatch, ENVS)
    recorder = Recorder(monkeypatch)
    section = {"id": "vf-lookup", "args": {"task": {"fail_first": 2}}}
    run_dir = run(tmp_path, tool_model_dir, "vf-tools", section)

    assert len(recorder.batches) == 2
    tool_turns = 0
    for r, outcome, _ in trained(recorder, outcomes):
        (trace,) = outcome.context.traces
        assert trace.ok and len(trace.calls) == trace.num_turns
        # the columns are the task's reward functions, each the score verifiers recorded
        assert r.rewards == [trace.rewards["looked"].score, trace.rewards["reply_length"].score]
        # weighted as the environment weighs them (1, 0.5): verifiers' own total
        assert outcome.reward == pytest.approx(trace.reward)
        masked = [i for i, m in enumerate(r.completion_mask) if not m]
        if trace.tool_messages:  # the tool's result sits between two replies, at loss 0
            tool_turns += 1
            assert masked and 0 < masked[0] and masked[-1] < len(r.completion_mask) - 1
            assert trace.tool_messages[0].content == f"value {outcome.context.task.data.idx}"
    assert tool_turns > 0, "the taught model never called the tool"

    train_lines = [x for x in read_jsonl(run_dir / "metrics.jsonl") if x["kind"] == "train"]
    assert [x["version"] for x in train_lines] == [1, 2]
    infra = sum(x["stop_reasons"].get("infra_error", 0) for x in train_lines)
    retries = sum(x["episode_infra_retries"] for x in train_lines)
    assert infra == 2 and retries == 2, train_lines  # the two failed setups, run again
    assert "reward/looked" in train_lines[-1] and "reward/reply_length" in train_lines[-1]
    failed = [o for o in outcomes if o.stop_reason == StopReason.INFRA_ERROR]
    assert all("ConnectionResetError" in o.error for o in failed)


def test_a_custom_multi_turn_env_trains_with_its_own_user_turns(
    tmp_path, tiny_model_dir, monkeypatch, outcomes
):
    importable(monkeypatch, ENVS)
    recorder = Recorder(monkeypatch)
    section = {"id": "vf_talk", "eval_args": {"num_tasks": 2}, "num_eval_tasks": 2}
    run_dir = run(tmp_path, tiny_model_dir, "vf-talk", section, eval_steps=2, **{
        "rollout.max_tokens": 8, "agent.eval_repeats": 1
    })  # fmt: skip

    two_turns = 0
    for r, outcome, _ in trained(recorder, outcomes):
        (trace,) = outcome.context.traces
        # in verifiers' order of the functions (priority, then name)
        assert r.rewards == [trace.rewards["replies"].score, trace.rewards["reply_length"].score]
        assert outcome.reward == pytest.approx(trace.reward)  # `replies` weighs 0
        if trace.num_turns == 2:  # the environment's turn between the replies, unsampled
            two_turns += 1
            user = [m.content for m in trace.messages if m.role == "user"]
            assert user[-1] == "observation: 42"
            assert 0 in r.completion_mask and r.completion_mask[-1] == 1
    assert two_turns, "no trained episode reached the environment's second turn"

    lines = read_jsonl(run_dir / "metrics.jsonl")
    evals = [x for x in lines if x["kind"] == "eval"]
    assert evals and all(x["eval_count"] + x["eval_untrainable"] == 2 for x in evals)
    assert "eval_score_reply_length" in evals[-1] and "eval_score_replies" in evals[-1]


def test_a_single_turn_taskset_trains_one_reply_per_episode_from_the_python_api(
    tmp_path, tiny_model_dir, monkeypatch, outcomes
):
    importable(monkeypatch, ENVS)
    recorder = Recorder(monkeypatch)
    section = {"id": "vf_single", "args": {"task": {"single_turn": True}}}
    run(tmp_path, tiny_model_dir, "vf-single", section, True, **{"rollout.max_tokens": 8})

    assert len(recorder.batches) == 2
    for r, outcome, _ in trained(recorder, outcomes):
        (trace,) = outcome.context.traces
        assert type(outcome.context).__name__ == "Episode" and trace.num_turns == 1
        assert all(r.completion_mask)  # one reply, every token of it sampled
        assert outcome.stop_reason in (StopReason.OK, StopReason.LENGTH)
