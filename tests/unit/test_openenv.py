"""The OpenEnv adapter against the real episode gateway (over a scripted engine) and real
OpenEnv servers (the guess-the-number example and tests/openenv_apps.py, served by uvicorn
in threads of this process).

Checked: the tokens an episode trains on are the engine's sampled ids and the observations
between them carry no loss; an invalid action is a tool failure the model reads; a group's
episodes run at once, each on its own WebSocket session; a dropped connection is an
infra_error that is run again while the group completes; server errors and timeouts are
`EnvironmentFailure`; a server with too few sessions is refused with what to change.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from types import SimpleNamespace

import pytest
from test_episode_gateway import ScriptedEngine, ServerThread, make_app, tokenizer_eos

from asyncgrpo.base.config import ConfigError
from asyncgrpo.base.config.environments import OpenEnvConfig
from asyncgrpo.base.episode import StopReason
from asyncgrpo.inference.client import EngineClient
from asyncgrpo.learning.agents.rollout_api import EnvironmentFailure
from asyncgrpo.learning.agents.runner import run_episode
from asyncgrpo.learning.environments import openenv as adapter
from asyncgrpo.learning.environments.openenv_server import ServedApp
from asyncgrpo.learning.rollout.episodes import EpisodeGroupBuilder, EpisodeSettings
from asyncgrpo.testing import build_tiny_tokenizer

SEED = 5


def secret(seed: int) -> int:
    return random.Random(seed).randint(1, 16)  # what examples/openenv_guess.py draws


def guess(number) -> str:
    arguments = json.dumps({"number": number})
    return f'<tool_call>{{"name": "guess", "arguments": {arguments}}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def envs():
    import openenv_apps  # imports openenv (seconds): once for the module

    from examples.openenv_guess import app

    # OpenEnv's server logs a traceback when it answers a client that already left (the
    # timed-out step, the dropped session): expected here, so kept out of the test output
    uvicorn_errors = logging.getLogger("uvicorn.error")
    uvicorn_errors.addFilter(_not_asgi_exceptions)
    with (
        ServerThread(app) as guess_url,
        ServerThread(openenv_apps.make_flaky_app()) as flaky_url,
        ServerThread(openenv_apps.narrow_app) as narrow_url,
        ServerThread(openenv_apps.faulty_app) as faulty_url,
    ):
        yield SimpleNamespace(
            guess=guess_url, flaky=flaky_url, narrow=narrow_url, faulty=faulty_url
        )
    uvicorn_errors.removeFilter(_not_asgi_exceptions)


def _not_asgi_exceptions(record: logging.LogRecord) -> bool:
    return "Exception in ASGI application" not in record.getMessage()


@pytest.fixture
def gateway(tokenizer):
    engine = ScriptedEngine(tokenizer)
    with ServerThread(make_app(engine)) as url:
        yield engine, url


def rollout_for(env_url: str, max_turns: int = 4):
    tool = adapter.action_tool(adapter.read_schema(env_url, 10)["action"])
    return adapter.episode_rollout(
        env_url, tool, OpenEnvConfig(url=env_url, message_timeout_s=10), max_turns, max_tokens=80
    )


def play_group(gateway_url: str, env_url: str, n: int, row: dict):
    """One group through `EpisodeGroupBuilder`; (group, outcomes in end order, stats)."""
    outcomes = []

    async def recorded(*args, **kwargs):
        outcome = await run_episode(*args, **kwargs)
        outcomes.append(outcome)
        return outcome

    async def scenario():
        async with EngineClient(gateway_url, admin_token="s3cret") as client:
            settings = EpisodeSettings(n, max_turns=4, max_infra_retries=2, retry_delay_s=0.0)
            builder = EpisodeGroupBuilder(client, rollout_for(env_url), settings, str, run=recorded)
            group = await builder.build(0, row)
            return group, builder.take_stats()

    group, stats = asyncio.run(scenario())
    return group, outcomes, stats


def test_an_episode_trains_on_the_sampled_tokens_and_not_on_observations(gateway, envs):
    engine, url = gateway
    target = secret(SEED)
    wrong = 16 if target != 16 else 1
    replies = [guess(40), guess(wrong), guess(target)]  # 40: outside the schema's 1..16
    engine.replies.extend(replies)

    async def scenario():
        async with EngineClient(url, admin_token="s3cret") as client:
            return await run_episode(client, rollout_for(envs.guess), {"seed": SEED}, max_turns=4)

    outcome = asyncio.run(scenario())
    assert outcome.stop_reason == StopReason.OK and outcome.error is None
    assert outcome.reward == pytest.approx(0.9)  # found at the second valid guess
    assert outcome.info["env_steps"] == 2 and outcome.info["env_done"] is True
    assert outcome.metrics.turns == 3 and outcome.metrics.tool_calls == 3
    assert outcome.metrics.tool_failures == 1
    [sample] = outcome.samples
    eos = [tokenizer_eos(engine)]
    sampled = [sample.input_ids[t] for t, m in enumerate(sample.loss_mask) if m]
    assert sampled == [i for r in replies for i in engine.char_ids(r) + eos]
    assert sample.input_ids == engine.prompts[-1] + engine.char_ids(replies[-1]) + eos
    decode = engine.tokenizer.decode
    first_prompt = decode(engine.prompts[0])
    assert "I picked a whole number from 1 to 16" in first_prompt  # the reset observation
    assert "Guess the secret number" in first_prompt  # the action schema, as the tool
    # what lies between the replies (the tool messages) carries no loss
    start = sample.loss_mask.index(1)
    between = decode(
        [t for t, m in zip(sample.input_ids[start:], sample.loss_mask[start:]) if not m]
    )
    assert "Error: invalid action: number: 40 is greater than the maximum of 16" in between
    assert ("lower (5 left)" if wrong > target else "higher (5 left)") in between


def test_a_groups_episodes_run_at_once_on_their_own_sessions(gateway, envs, monkeypatch):
    engine, url = gateway
    engine.delay = 0.2  # each reply takes a while: sequential episodes could not overlap
    engine.replies.extend([guess(secret(SEED))] * 4)
    sessions = []
    enter, leave = adapter.EnvSession.__aenter__, adapter.EnvSession.__aexit__

    async def opened(self):
        await enter(self)
        port = self.client._ws.local_address[1]
        sessions.append(SimpleNamespace(session=self, port=port, opened=time.monotonic()))
        return self

    async def closed(self, *exc):
        next(s for s in sessions if s.session is self).closed = time.monotonic()
        await leave(self, *exc)

    monkeypatch.setattr(adapter.EnvSession, "__aenter__", opened)
    monkeypatch.setattr(adapter.EnvSession, "__aexit__", closed)
    group, outcomes, _ = play_group(url, envs.guess, 4, {"seed": SEED})
    assert [o.reward for o in outcomes] == [1.0] * 4 and len(group.rollouts) == 4
    assert len({s.port for s in sessions}) == 4  # four WebSocket sessions, one per episode
    assert max(s.opened for s in sessions) < min(s.closed for s in sessions)  # all at once


def test_a_dropped_connection_is_an_infra_error_run_again(gateway, envs):
    engine, url = gateway
    engine.replies.extend([guess(secret(SEED))] * 4)  # the dropped episode's retry: a 4th
    group, outcomes, stats = play_group(url, envs.flaky, 3, {"seed": SEED})
    reasons = [o.stop_reason for o in outcomes]
    assert reasons.count(StopReason.INFRA_ERROR) == 1 and reasons.count(StopReason.OK) == 3
    [failed] = [o for o in outcomes if o.stop_reason == StopReason.INFRA_ERROR]
    assert failed.reward is None and "OpenEnv step failed" in failed.error
    assert stats["episode_infra_retries"] == 1
    assert stats["stop_reasons"] == {"infra_error": 1, "ok": 3}
    assert len(group.rollouts) == 3 and all(r.rewards == [1.0] for r in group.rollouts)


def test_server_errors_and_silence_are_environment_failures(envs):
    async def scenario():
        async with adapter.EnvSession(envs.faulty, timeout_s=0.5) as env:
            await env.reset(seed=1)
            with pytest.raises(EnvironmentFailure, match="EXECUTION_ERROR"):
                await env.step({"number": 13})
            with pytest.raises(EnvironmentFailure, match="no answer within 0.5 s"):
                await env.step({"number": 14})
        async with adapter.EnvSession(envs.faulty, timeout_s=5) as env:
            await env.reset(seed=1)
            with pytest.raises(adapter.ActionRejected, match="VALIDATION_ERROR"):
                await env.step({"number": "many"})  # the server's own validation

    asyncio.run(scenario())


def test_a_server_with_too_few_sessions_is_refused(envs):
    with pytest.raises(ConfigError) as refused:
        adapter.check_concurrency(envs.narrow, 4, 5)
    message = str(refused.value)
    assert "allows 2 concurrent session(s)" in message
    assert "rollout.num_generations=4" in message
    assert "max_concurrent_envs=4 or more" in message
    assert "SUPPORTS_CONCURRENT_SESSIONS = True" in message
    adapter.check_concurrency(envs.narrow, 2, 5)  # enough: no error


def test_an_app_that_cannot_start_is_a_clear_error():
    with pytest.raises(ConfigError, match="exited with code .* before serving"):
        ServedApp("no_such_module_here:app", startup_timeout_s=60)


def test_action_schema_becomes_one_tool():
    bare = {"title": "Action", "type": "object", "properties": {"metadata": {"type": "object"}}}
    tool = adapter.action_tool(bare)["function"]
    assert tool["name"] == "step" and tool["parameters"]["properties"] == {}
    schema = {
        "title": "MoveTileAction",
        "description": "Move a tile.",
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "tile": {"title": "Tile", "type": "integer"},
            "metadata": {"title": "Metadata", "type": "object"},
        },
        "required": ["tile"],
    }
    tool = adapter.action_tool(schema)["function"]
    assert tool["name"] == "move_tile" and tool["description"] == "Move a tile."
    assert tool["parameters"] == {
        "type": "object",
        "additionalProperties": False,
        "properties": {"tile": {"type": "integer"}},
        "required": ["tile"],
    }


def test_observations_and_the_opening_messages():
    assert adapter.render_observation({"message": "hi", "metadata": {"x": 1}}) == "hi"
    assert adapter.render_observation({"board": [1, 2], "turn": "x"}) == (
        '{"board": [1, 2], "turn": "x"}'
    )
    assert adapter.opening_messages({}, None, "obs") == [{"role": "user", "content": "obs"}]
    assert adapter.opening_messages({"prompt": "Play."}, None, "obs") == [
        {"role": "user", "content": "Play.\n\nobs"}
    ]
    system = {"role": "system", "content": "Be brief."}
    example = [system, {"role": "user", "content": "Go."}, {"role": "assistant", "content": "8"}]
    assert adapter.opening_messages({"prompt": "Again."}, example, "obs") == [
        *example,
        {"role": "user", "content": "Again.\n\nobs"},
    ]
    assert adapter.opening_messages({}, example, "obs") == [
        *example,
        {"role": "user", "content": "obs"},
    ]
    assert adapter.opening_messages({}, "Go.", "obs") == [{"role": "user", "content": "Go.\n\nobs"}]
    assert example[1] == {"role": "user", "content": "Go."}  # the shared preamble untouched
