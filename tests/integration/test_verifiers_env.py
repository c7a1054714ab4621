"""Classic-API verifiers environments (verifiers 0.3.x, `.venv`) through the real pipeline
(tiny random model), and the adapter's decisions: the rubric's group call, the refusal of
environments of the new API, which need verifiers 0.4.

The pipeline run trains 2 steps on `verifiers_test_env` (two turns with an observation
between them; its env_response raises on its first 2 calls). Checked against what the
gateway recorded and what verifiers itself saw (its trajectory's token ids, asked for
with `return_token_ids`): the trained tokens are the sampled ones, the observation
carries no loss, a group's episodes ran at once on states of their own, the group call
saw the whole group, and the broken environment cost two infra_error retries, not the run.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_train import Recorder, base_config, flat, read_jsonl

from asyncgrpo import AsyncGRPOConfig
from asyncgrpo.base.config import ConfigError, RunConfig
from asyncgrpo.base.episode import StopReason
from asyncgrpo.learning.rollout import episodes as episodes_mod
from asyncgrpo.run.loop import train

pytest.importorskip("verifiers.legacy")  # the classic API: verifiers 0.3.x, not 0.4
REPO = Path(__file__).parents[2]


@pytest.mark.heavy  # a whole training run (engine process, gateway, trainer): 10-20 s
def test_a_verifiers_environment_trains_on_the_sampled_tokens(
    tmp_path, tiny_model_dir, monkeypatch
):
    recorder = Recorder(monkeypatch)
    outcomes = []

    async def recording_run_episode(*args, **kwargs):
        outcome = await run_episode(*args, **kwargs)
        outcomes.append(outcome)
        return outcome

    run_episode = episodes_mod.run_episode
    monkeypatch.setattr(episodes_mod, "run_episode", recording_run_episode)
    cfg = base_config(
        tmp_path,
        tiny_model_dir,
        "verifiers",
        max_steps=2,
        **{
            "engine.max_model_len": 256,
            "rollout.num_generations": 3,
            "rollout.max_tokens": 6,
            "agent.max_turns": 2,
            "agent.episode_timeout_s": 60,
            "agent.verifiers": {
                "id": "verifiers_test_env",
                "args": {"fail_first": 2, "eval_size": 0},  # no evaluation: faster
                "sampling_args": {"logprobs": True, "extra_body": {"return_token_ids": True}},
            },
        },
    )
    run_dir = train(AsyncGRPOConfig(**flat(cfg)))

    assert len(recorder.batches) == 2
    # an infra_error episode is never trained (its retry is), and its retry may sample the
    # very same first turn (seeded sampling): map sequences to the episodes that counted
    counted = [o for o in outcomes if o.stop_reason != StopReason.INFRA_ERROR]
    by_sequence = {tuple(s.input_ids): (o, s) for o in counted for s in o.samples}
    two_turn = 0
    overlapping = []  # per trained group: did all its episodes run at the same time?
    for groups in recorder.batches:
        for group in groups:
            states = []
            for r in group.rollouts:
                outcome, sample = by_sequence[tuple(r.prompt_ids + r.completion_ids)]
                assert [0] * len(r.prompt_ids) + r.completion_mask == sample.loss_mask
                state = outcome.context
                states.append(state)
                assert outcome.info["rubric_group_size_seen"] == len(group.rollouts)
                assert r.rewards == [state["reward"]]
                turns = [step["tokens"] for step in state["trajectory"]]
                sampled = [t for t, m in zip(r.completion_ids, r.completion_mask, strict=True) if m]
                recorded = [t for turn in turns for t in turn["completion_ids"]]
                if outcome.info.get("verifiers_error") == "EmptyModelResponseError":
                    # the random model's last reply was empty (EOS alone, at any turn): verifiers
                    # ends the episode before recording that turn; the reply is trained as sampled
                    assert sampled[: len(recorded)] == recorded and len(sampled) > len(recorded)
                    if not turns:
                        continue
                else:
                    # what verifiers was given, call by call, is what is trained, token for token
                    assert sampled == recorded
                assert r.prompt_ids == turns[0]["prompt_ids"]
                if len(turns) == 2:  # the observation sits between the replies, unsampled
                    two_turn += 1
                    first = len(turns[0]["completion_ids"])
                    assert r.completion_mask[first] == 0
                    full = r.prompt_ids + r.completion_ids
                    assert full[: len(turns[1]["prompt_ids"])] == turns[1]["prompt_ids"]
            assert len({id(s) for s in states}) == len({s["trajectory_id"] for s in states})
            assert len(states) == len({s["trajectory_id"] for s in states})
            spans = [(s["timing"].generation.start, s["timing"].generation.end) for s in states]
            overlapping.append(max(a for a, _ in spans) < min(b for _, b in spans))
    assert two_turn, "no trained episode reached its second turn"
    # every group ran its episodes at once, except at most the two that held an episode
    # run again after the broken env_response (its retry starts a second later)
    assert len(overlapping) == 4 and sum(overlapping) >= 2, overlapping

    lines = read_jsonl(run_dir / "metrics.jsonl")
    train_lines = [x for x in lines if x["kind"] == "train"]
    assert [x["version"] for x in train_lines] == [1, 2]
    infra = sum(x["stop_reasons"].get("infra_error", 0) for x in train_lines)
    retries = sum(x["episode_infra_retries"] for x in train_lines)
    assert infra == 2 and retries == 2, train_lines
    assert all("reward/rubric" in x for x in train_lines)


def rubric_env():
    from examples.verifiers_word_budget import load_environment

    return load_environment(num_train=2, num_eval=2)


def state(replies: list[str], targets: list[int]) -> dict:
    completion = [m for text in replies for m in _assistant_then_user(text)][:-1]
    return {
        "prompt": [],
        "completion": completion,
        "info": {"topics": ["cats", "tea"], "targets": targets},
        "trajectory": [],
    }


def _assistant_then_user(text: str):
    import verifiers.legacy as vf

    return [vf.AssistantMessage(content=text), vf.UserMessage(content="next")]


def test_the_rubric_group_call_scores_the_whole_group(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from asyncgrpo.learning.environments.verifiers_episodes import RubricScorer

    targets = [2, 3]
    states = [
        state(["big cats", "tea is hot"], targets),  # exact, 18 characters
        state(["small cats", "green tea cup"], targets),  # exact, 23 characters: no bonus
        state(["cats", "tea is very hot"], targets),  # 1/2 and 2/3 words off: 0.5, 2/3
    ]
    outcomes = [SimpleNamespace(context=s, info={}) for s in states]
    values = asyncio.run(RubricScorer(rubric_env()).score({}, outcomes))
    # word_budget (weight 1) + 0.5 * shortest_exact_bonus; num_turns is a 0-weight metric
    expected = [1.0 + 0.5, 1.0, (0.5 + (1 - 1 / 3)) / 2]
    assert values == [[pytest.approx(v)] for v in expected]
    assert [o.info["rubric_shortest_exact_bonus"] for o in outcomes] == [1.0, 0.0, 0.0]
    # alone, the second episode is the shortest exact one of its group: the term is relative
    alone = [SimpleNamespace(context=state(["small cats", "green tea cup"], targets), info={})]
    assert asyncio.run(RubricScorer(rubric_env()).score({}, alone)) == [[pytest.approx(1.5)]]


def test_an_environment_of_the_new_api_is_refused_naming_the_version(tmp_path, monkeypatch):
    # a package as verifiers 0.4's vf-init lays one out: its Taskset exported, no
    # load_environment(); verifiers 0.3.1 (this environment) cannot run it
    (tmp_path / "new_api_env.py").write_text(
        "import verifiers.v1 as vf\n__all__ = ['MyTaskset']\n"
        "class MyTaskset(vf.Taskset):\n    def load(self):\n        return []\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = RunConfig.model_validate({"agent": {"verifiers": {"id": "new-api-env"}}})
    from asyncgrpo.learning.environments import episode_source

    with pytest.raises(ConfigError) as err:
        episode_source(cfg)
    message = str(err.value)
    assert "has no load_environment()" in message and "verifiers 0.3.1" in message
    assert "install verifiers 0.4" in message and "environment of its own" in message


def test_settings_of_the_new_api_are_refused_under_the_classic_one(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    section = {"id": "examples.verifiers_word_budget", "eval_args": {"split": "test"}}
    cfg = RunConfig.model_validate({"agent": {"verifiers": section}})
    from asyncgrpo.learning.environments import episode_source

    with pytest.raises(ConfigError, match=r"\['eval_args'\] are settings of verifiers 0.4"):
        episode_source(cfg)


def test_a_module_without_load_environment_is_refused(tmp_path, monkeypatch):
    (tmp_path / "v1_taskset_like.py").write_text("__all__ = ['MyTaskset']\nMyTaskset = None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = RunConfig.model_validate({"agent": {"verifiers": {"id": "v1-taskset-like"}}})
    from asyncgrpo.learning.environments import episode_source

    with pytest.raises(ConfigError, match="has no load_environment.*runs only classic"):
        episode_source(cfg)


def test_sampling_args_cannot_override_the_recipes_temperature():
    with pytest.raises(ValueError, match="rollout.temperature"):
        RunConfig.model_validate(
            {"agent": {"verifiers": {"id": "x", "sampling_args": {"temperature": 0.5}}}}
        )


def test_how_a_verifiers_rollout_ended_becomes_its_stop_reason():
    import httpx
    import openai
    import verifiers.legacy as vf

    from asyncgrpo.base.episode import StopReason
    from asyncgrpo.learning.agents.rollout_api import EnvironmentFailure
    from asyncgrpo.learning.environments.verifiers_episodes import VerifiersRollout

    ending = VerifiersRollout(vf, None, {}).ending
    request = httpx.Request("POST", "http://gateway/v1/chat/completions")

    def model_error(cause: Exception) -> Exception:
        try:
            raise vf.ModelError() from cause
        except vf.ModelError as exc:
            return exc

    def refused(text: str) -> Exception:
        response = httpx.Response(400, request=request, json={"error": {"message": text}})
        return openai.BadRequestError(text, response=response, body=None)

    done = {"error": None, "stop_condition": "max_turns_reached"}  # a SingleTurnEnv's end
    assert ending(done).stop_reason == StopReason.OK and ending(done).context is done
    assert ending({"error": None, "is_truncated": True}).stop_reason == StopReason.LENGTH
    assert ending({"error": None, "prompt_too_long": True}).stop_reason == StopReason.LENGTH
    assert ending({"error": None, "timed_out": True}).stop_reason == StopReason.TIMEOUT
    empty = ending({"error": vf.EmptyModelResponseError("no content")})
    assert empty.stop_reason == StopReason.OK  # the model's fault: the rubric scores it
    assert empty.info == {"verifiers_error": "EmptyModelResponseError"}
    past = ending({"error": model_error(refused("max_turns=2 reached for this episode"))})
    assert past.stop_reason == StopReason.MAX_TURNS and past.context is not None
    with pytest.raises(openai.APIConnectionError):  # the runner's infra_error
        ending({"error": model_error(openai.APIConnectionError(request=request))})
    with pytest.raises(openai.BadRequestError):  # another 4xx: the runner's tool_error
        ending({"error": model_error(refused("messages: bad role"))})
    with pytest.raises(EnvironmentFailure):
        ending({"error": vf.SandboxError("sandbox gone")})
