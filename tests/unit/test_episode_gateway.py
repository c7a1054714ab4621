"""The episode gateway in-process over a scripted engine: auth, retries, limits, expiry, tools.

(Named apart from tests/integration/test_episodes.py: pytest's default import
mode refuses two test modules with the same basename.)
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections import deque

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from asyncgrpo.base.episode import BranchSequence, StopReason
from asyncgrpo.inference.client import EngineClient, EngineUnavailable
from asyncgrpo.inference.engine.engine import Engine
from asyncgrpo.inference.engine.types import RequestError, TokenDelta
from asyncgrpo.inference.server import ServerSettings, create_app
from asyncgrpo.inference.server.episodes import EpisodeRegistry, ReplayCache, body_digest
from asyncgrpo.learning.agents.rollout_api import reward_scope
from asyncgrpo.learning.agents.runner import (
    LLM,
    Result,
    RewardError,
    _unpack,
    classify,
    environment_rollout,
    run_episode,
    run_subprocess_episode,
    tool_loop,
    training_row,
)
from asyncgrpo.learning.agents.tools import ToolBox
from asyncgrpo.testing import build_tiny_tokenizer

ADMIN = {"Authorization": "Bearer s3cret"}
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        },
    },
}


class ScriptedEngine:
    """Answers each request with the next scripted text, one token per character.

    Per-character ids are what a sampler may produce and what re-encoding the
    text never gives back, so exactness is visible. `delay` keeps a call in flight.
    """

    model_name = "scripted"
    max_model_len = 2048
    check_request = Engine.check_request

    class config:
        max_num_seqs = 4
        max_request_sequences = 256

    def __init__(self, tokenizer, replies=(), delay: float = 0.0):
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.replies = deque(replies)
        self.delay = delay
        self.prompts: list[list[int]] = []
        self.weight_version = 0

    def start(self):
        pass

    def shutdown(self):
        pass

    def is_alive(self):
        return True

    def char_ids(self, text: str) -> list[int]:
        return [i for ch in text for i in self.tokenizer(ch, add_special_tokens=False)["input_ids"]]

    async def generate(self, prompt_ids, params, request_id=None):
        self.check_request(prompt_ids, params)
        self.prompts.append(list(prompt_ids))
        for index in range(params.n):
            text = self.replies.popleft() if self.replies else "ok"
            await asyncio.sleep(self.delay)
            ids = self.char_ids(text)[: params.max_tokens]
            finish = "length" if len(ids) == params.max_tokens else "stop"
            if finish == "stop":
                ids.append(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
            yield TokenDelta(
                index,
                ids,
                [-0.1 * (k + 1) for k in range(len(ids))],
                [self.weight_version] * len(ids),
                finish_reason=finish,
            )


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def make_app(engine, **settings):
    return create_app(engine, ServerSettings(admin_token="s3cret", **settings))


def open_episode(client, **body):
    r = client.post("/episodes", headers=ADMIN, json=body or None)
    assert r.status_code == 200, r.text
    return r.json()


def chat(client, episode, messages, headers=None, **body):
    auth = {"Authorization": f"Bearer {episode['api_key']}", **(headers or {})}
    return client.post(
        f"{episode['base_path']}/chat/completions",
        headers=auth,
        json={"messages": messages, **body},
    )


# ---- pure parts ----


def test_body_digest_ignores_key_order_and_spacing():
    assert body_digest(b'{"a": 1, "b": [1, 2]}') == body_digest(b'{"b":[1,2],"a":1}')
    assert body_digest(b'{"a": 1}') != body_digest(b'{"a": 2}')
    assert body_digest(b"not json") == body_digest(b"not json")


def test_replay_cache_forgets_failed_originals_and_old_entries():
    async def scenario():
        cache = ReplayCache(capacity=2)
        loop = asyncio.get_running_loop()
        ok, failed = loop.create_future(), loop.create_future()
        ok.set_result({"id": 1})
        failed.set_exception(RequestError("boom", 500))
        cache.put("ok", ok)
        cache.put("failed", failed)
        assert cache.get("ok") is ok and cache.get("failed") is None
        pending = loop.create_future()
        cache.put("pending", pending)  # evicts "ok"
        assert cache.get("pending") is pending and cache.get("ok") is None
        pending.cancel()
        failed.exception()

    asyncio.run(scenario())


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_registry_bounds_open_episodes_and_expires_idle_ones():
    clock = Clock()
    registry = EpisodeRegistry(max_open=2, idle_timeout_s=10, max_turns=5, clock=clock)
    a, b = registry.create(None), registry.create(None, max_turns=50)
    assert b.max_turns == 5  # the server's cap wins
    with pytest.raises(RequestError) as full:
        registry.create(None)
    assert full.value.status == 503
    clock.now = 6
    registry.authorize(a.id, f"Bearer {a.key}")  # a call keeps `a` alive
    clock.now = 12
    registry.create(None)  # `b` idled out, freeing a place
    assert b.closed and b.id not in registry.open and a.id in registry.open
    assert registry.stats() == {"open": 2, "max_open": 2, "opened": 3, "refused": 1, "expired": 1}
    with pytest.raises(RequestError) as expired:
        registry.authorize(b.id, f"Bearer {b.key}")
    assert expired.value.status == 409


def test_registry_answers_401_alike_for_unknown_ids_and_wrong_keys():
    registry = EpisodeRegistry(max_tombstones=1)
    a, b = registry.create(None), registry.create(None)
    for episode_id, header in [
        (a.id, f"Bearer {b.key}"),  # another episode's key
        ("nope", f"Bearer {a.key}"),  # unknown episode
        (a.id, a.key),  # no scheme
        (a.id, ""),
    ]:
        with pytest.raises(RequestError) as refused:
            registry.authorize(episode_id, header)
        assert refused.value.status == 401 and "unknown episode or wrong" in refused.value.message
    registry.retire(a)
    with pytest.raises(RequestError) as wrong_key:
        registry.authorize(a.id, f"Bearer {b.key}")
    assert wrong_key.value.status == 401  # a closed episode is not revealed either
    registry.retire(b)  # evicts a's tombstone (max_tombstones=1)
    with pytest.raises(RequestError) as forgotten:
        registry.authorize(a.id, f"Bearer {a.key}")
    assert forgotten.value.status == 401


# ---- routes ----


def test_episode_routes_security(tokenizer):
    with TestClient(make_app(ScriptedEngine(tokenizer)), raise_server_exceptions=False) as client:
        assert client.post("/episodes").status_code == 401
        assert client.post("/episodes", headers={"Authorization": "Bearer x"}).status_code == 401
        a, b = open_episode(client), open_episode(client)
        assert a["base_url"] == f"http://testserver/e/{a['episode_id']}/v1"
        assert a["base_path"] == f"/e/{a['episode_id']}/v1" and a["model"] == "scripted"
        user = [{"role": "user", "content": "Hi"}]
        assert chat(client, a, user).status_code == 200
        stolen = chat(client, {**a, "api_key": b["api_key"]}, user)
        assert stolen.status_code == 401 and stolen.json()["error"]["type"] == "AuthenticationError"
        unknown = chat(client, {**a, "base_path": "/e/nope/v1"}, user)
        assert unknown.status_code == 401
        models = client.get(f"{a['base_path']}/models", headers={"Authorization": "Bearer x"})
        assert models.status_code == 401
        ok = client.get(
            f"{a['base_path']}/models", headers={"Authorization": f"Bearer {a['api_key']}"}
        )
        assert ok.json()["data"][0]["id"] == "scripted"
        assert client.post(f"/episodes/{a['episode_id']}/close", json={}).status_code == 401
        closed = client.post(
            f"/episodes/{a['episode_id']}/close", headers=ADMIN, json={"reward": 1}
        )
        assert closed.status_code == 200 and closed.json()["metrics"]["turns"] == 1
        assert chat(client, a, user).status_code == 409
        again = client.post(f"/episodes/{a['episode_id']}/close", headers=ADMIN, json={})
        assert again.status_code == 409
        assert client.get("/episodes/nope", headers=ADMIN).status_code == 404
        assert chat(client, b, user).status_code == 200  # the other episode is unaffected


def test_tool_calls_parsed_and_malformed_text_is_content(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL, "<tool_call>{not json</tool_call>", "5"])
    with TestClient(make_app(engine), raise_server_exceptions=False) as client:
        episode = open_episode(client)
        user = [{"role": "user", "content": "What is 2 + 3?"}]
        first = chat(client, episode, user, tools=[ADD_TOOL]).json()
        choice = first["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        [call] = choice["message"]["tool_calls"]
        assert call["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
        assert "# Tools" in tokenizer.decode(engine.prompts[0])  # the fallback description
        messages = user + [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "5"},
        ]
        bad = chat(client, episode, messages, tools=[ADD_TOOL])
        assert bad.status_code == 200
        assert bad.json()["choices"][0]["message"]["content"] == "<tool_call>{not json</tool_call>"
        assert bad.json()["choices"][0]["finish_reason"] == "stop"
        info = client.get(f"/episodes/{episode['episode_id']}", headers=ADMIN).json()
        assert info["malformed_tool_calls"] == 1 and info["tool_calls"] == 1
        assert info["turns"] == 2 and info["branches"] == 1
        result = client.post(
            f"/episodes/{episode['episode_id']}/close",
            headers=ADMIN,
            json={"reward": 0.5, "stop_reason": "ok", "tool_failures": 0},
        ).json()
        [sample] = result["samples"]
        assert result["metrics"]["malformed_tool_calls"] == 1 and result["reward"] == 0.5
        # exact: the first prompt, the sampled ids, the bridge (tool result), the second sample
        assert sample["input_ids"][: len(engine.prompts[0])] == engine.prompts[0]
        assert sample["input_ids"][: len(engine.prompts[1])] == engine.prompts[1]
        first_ids = engine.char_ids(CALL)
        start = len(engine.prompts[0])
        assert sample["input_ids"][start : start + len(first_ids)] == first_ids
        assert (
            sum(sample["loss_mask"])
            == len(first_ids)
            + 1
            + len(engine.char_ids(bad.json()["choices"][0]["message"]["content"]))
            + 1
        )


def test_sdk_retry_returns_the_recorded_turn_without_forking(tokenizer):
    engine = ScriptedEngine(tokenizer, ["first", "second", "third"])
    with TestClient(make_app(engine), raise_server_exceptions=False) as client:
        episode = open_episode(client)
        user = [{"role": "user", "content": "Hi"}]
        original = chat(client, episode, user, seed=1).json()
        retried = chat(client, episode, user, headers={"x-stainless-retry-count": "1"}, seed=1)
        assert retried.json() == original
        reordered = chat(client, episode, user, headers={"x-stainless-retry-count": "2"}, seed=1)
        assert reordered.json()["id"] == original["id"]
        info = client.get(f"/episodes/{episode['episode_id']}", headers=ADMIN).json()
        assert info["turns"] == 1 and info["deduped_retries"] == 2
        # not a retry: a second sample of the same request is recorded
        fresh = chat(client, episode, user, seed=1).json()
        assert fresh["choices"][0]["message"]["content"] == "second"
        # a retry of a request never seen runs
        unseen = chat(client, episode, user, headers={"x-stainless-retry-count": "1"}, seed=2)
        assert unseen.json()["choices"][0]["message"]["content"] == "third"
        info = client.get(f"/episodes/{episode['episode_id']}", headers=ADMIN).json()
        assert info["turns"] == 3


def test_retry_of_a_call_in_flight_awaits_the_same_result(tokenizer):
    engine = ScriptedEngine(tokenizer, ["only once", "never"], delay=0.2)
    app = make_app(engine)

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            episode = (await http.post("/episodes", headers=ADMIN)).json()
            url = f"{episode['base_path']}/chat/completions"
            body = {"messages": [{"role": "user", "content": "Hi"}]}
            auth = {"Authorization": f"Bearer {episode['api_key']}"}
            first = asyncio.create_task(http.post(url, json=body, headers=auth))
            await asyncio.sleep(0.05)
            retry = await http.post(
                url, json=body, headers={**auth, "x-stainless-retry-count": "1"}
            )
            first = await first
            info = (await http.get(f"/episodes/{episode['episode_id']}", headers=ADMIN)).json()
            return first.json(), retry.json(), info

    first, retry, info = asyncio.run(scenario())
    assert first == retry and first["choices"][0]["message"]["content"] == "only once"
    assert info["turns"] == 1 and info["deduped_retries"] == 1 and len(engine.prompts) == 1


def test_max_turns_body_limit_and_stream(tokenizer):
    engine = ScriptedEngine(tokenizer, ["a", CALL, "c"])
    app = make_app(engine, max_body_bytes=4000)
    with TestClient(app, raise_server_exceptions=False) as client:
        episode = open_episode(client, max_turns=2)
        user = [{"role": "user", "content": "Hi"}]
        assert chat(client, episode, user).status_code == 200
        with client.stream(
            "POST",
            f"{episode['base_path']}/chat/completions",
            headers={"Authorization": f"Bearer {episode['api_key']}"},
            json={"messages": user, "stream": True, "tools": [ADD_TOOL]},
        ) as stream:
            lines = [line for line in stream.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and '"tool_calls"' in lines[0]
        refused = chat(client, episode, user)
        assert refused.status_code == 400 and "max_turns" in refused.json()["error"]["message"]
        huge = chat(client, episode, [{"role": "user", "content": "x" * 5000}])
        assert huge.status_code == 413
        bad = chat(client, episode, "not a list")
        assert bad.status_code == 422
        info = client.get(f"/episodes/{episode['episode_id']}", headers=ADMIN).json()
        assert info["turns"] == 2 and info["refused_turns"] == 1


def test_plain_chat_route_parses_tool_calls_with_the_fallback(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL, CALL])
    with TestClient(make_app(engine), raise_server_exceptions=False) as client:
        body = {"messages": [{"role": "user", "content": "2 + 3?"}], "tools": [ADD_TOOL]}
        done = client.post("/v1/chat/completions", json=body).json()
        assert done["choices"][0]["finish_reason"] == "tool_calls"
        assert done["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "add"
        assert "Add two integers." in tokenizer.decode(engine.prompts[0])
        none = client.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).json()
        assert none["choices"][0]["message"]["content"] == CALL


# ---- the runner, against the gateway served over real HTTP ----


class ServerThread:
    """A uvicorn server in a thread of this process (the official openai client needs HTTP)."""

    def __init__(self, app):
        import uvicorn

        from asyncgrpo.base.ports import free_port

        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


@pytest.fixture
def scripted(tokenizer):
    engine = ScriptedEngine(tokenizer)
    with ServerThread(make_app(engine)) as url:
        yield engine, url


def run(coro_fn, url, *args, **kwargs):
    async def scenario():
        async with EngineClient(url, admin_token="s3cret") as client:
            return await coro_fn(client, *args, **kwargs)

    return asyncio.run(scenario())


def test_run_episode_with_tool_loop_returns_exact_samples(scripted):
    engine, url = scripted
    engine.replies.extend([CALL, CALL.replace('"b": 3', '"b": "x"'), "The answer is 5."])
    toolbox = ToolBox([add])

    async def rollout(task, llm):
        done = await tool_loop(llm, [{"role": "user", "content": task["question"]}], toolbox)
        return Result(float("5" in done.final["content"]), tool_failures=done.tool_failures)

    outcome = run(run_episode, url, rollout, {"question": "What is 2 + 3?"}, max_turns=5)
    assert outcome.stop_reason == StopReason.OK and outcome.reward == 1.0 and outcome.error is None
    assert outcome.metrics.turns == 3 and outcome.metrics.tool_calls == 2
    assert outcome.metrics.tool_failures == 1 and outcome.metrics.branches == 1
    [sample] = outcome.samples
    # each prompt the engine saw extends the previous one: one sequence, exact ids
    for earlier, later in zip(engine.prompts, engine.prompts[1:]):
        assert later[: len(earlier)] == earlier
    completion = engine.char_ids("The answer is 5.") + [tokenizer_eos(engine)]
    assert sample.input_ids == engine.prompts[-1] + completion
    sampled = [sample.input_ids[t] for t, m in enumerate(sample.loss_mask) if m]
    eos = [tokenizer_eos(engine)]
    wrong = CALL.replace('"b": 3', '"b": "x"')
    assert sampled == engine.char_ids(CALL) + eos + engine.char_ids(wrong) + eos + completion
    assert toolbox.errors == {"wrong_type": 1}


def tokenizer_eos(engine):
    return engine.tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_run_episode_maps_failures_to_stop_reasons(scripted):
    engine, url = scripted

    async def slow(task, llm):
        await asyncio.sleep(5)
        return 1.0

    async def reward_bug(task, llm):
        async with llm.client() as oai:
            await oai.chat.completions.create(
                model=llm.model, messages=[{"role": "user", "content": "Hi"}]
            )
        with reward_scope():
            return 1 / 0

    async def agent_bug(task, llm):
        raise KeyError("oops")

    async def unreachable(task, llm):
        dead = LLM("http://127.0.0.1:9/v1", llm.api_key, llm.model, max_retries=0)
        async with dead.client() as oai:
            await oai.chat.completions.create(
                model=dead.model, messages=[{"role": "user", "content": "Hi"}]
            )

    async def too_many_turns(task, llm):
        async with llm.client() as oai:
            for _ in range(3):
                await oai.chat.completions.create(
                    model=llm.model, messages=[{"role": "user", "content": "Hi"}]
                )
        return 1.0

    timeout = run(
        run_episode, url, slow, {}, episode_timeout_s=0.2, failure_rewards={"timeout": 0.0}
    )
    assert timeout.stop_reason == StopReason.TIMEOUT and timeout.reward == 0.0
    broken = run(run_episode, url, reward_bug, {})
    assert broken.stop_reason == StopReason.REWARD_ERROR and broken.reward is None
    assert "ZeroDivisionError" in broken.error and len(broken.samples) == 1
    assert not broken.trainable
    bug = run(run_episode, url, agent_bug, {})
    assert bug.stop_reason == StopReason.TOOL_ERROR and bug.reward is None and "oops" in bug.error
    infra = run(run_episode, url, unreachable, {})
    assert infra.stop_reason == StopReason.INFRA_ERROR and infra.reward is None
    capped = run(run_episode, url, too_many_turns, {}, max_turns=2)
    assert capped.stop_reason == StopReason.MAX_TURNS and capped.metrics.turns == 2
    with pytest.raises(ValueError, match="infra_error"):
        run(run_episode, url, slow, {}, failure_rewards={"infra_error": 0.0})
    stats = run(lambda client: client.episode_stats(), url)
    assert stats["open"] == 0 and stats["closed"] == 5  # every episode was closed


def test_subprocess_agent_gets_the_episode_endpoint(scripted, tmp_path):
    engine, url = scripted
    engine.replies.extend(["42"])
    agent = tmp_path / "agent.py"
    agent.write_text(
        "import json, os, sys\n"
        "import openai\n"
        "task = json.loads(sys.stdin.read())\n"
        "client = openai.OpenAI()  # OPENAI_BASE_URL / OPENAI_API_KEY from the environment\n"
        "reply = client.chat.completions.create(model=os.environ['OPENAI_MODEL'],\n"
        "    messages=[{'role': 'user', 'content': task['q']}])\n"
        "print('thinking...')\n"
        "print(json.dumps({'reward': float(reply.choices[0].message.content == '42')}))\n"
    )
    outcome = run(run_subprocess_episode, url, [sys.executable, str(agent)], {"q": "6 * 7?"})
    assert outcome.stop_reason == StopReason.OK and outcome.reward == 1.0
    assert outcome.metrics.turns == 1
    crash = run(run_subprocess_episode, url, [sys.executable, "-c", "raise SystemExit(3)"], {})
    assert crash.stop_reason == StopReason.TOOL_ERROR and "exited with 3" in crash.error
    silent = run(run_subprocess_episode, url, [sys.executable, "-c", "print('done')"], {})
    assert silent.stop_reason == StopReason.REWARD_ERROR


class Guess:
    """Guess the number: the reply must contain it; one reward point when it does."""

    def reset(self, task):
        self.answer = task["answer"]
        return "Guess my number."

    async def step(self, action):
        hit = self.answer in action
        return ("Correct." if hit else "No, try again."), float(hit), hit


def test_environment_rollout(scripted):
    engine, url = scripted
    engine.replies.extend(["3", "5", "7"])
    outcome = run(run_episode, url, environment_rollout(Guess, max_turns=4), {"answer": "5"})
    assert outcome.stop_reason == StopReason.OK and outcome.reward == 1.0
    assert outcome.info["turns"] == 2 and outcome.metrics.turns == 2
    engine.replies.extend(["1", "2"])
    capped = run(run_episode, url, environment_rollout(Guess, max_turns=2), {"answer": "5"})
    assert capped.stop_reason == StopReason.MAX_TURNS and capped.reward == 0.0


def status_error(cls, status, message):
    response = httpx.Response(status, request=httpx.Request("POST", "http://gw/v1/chat"))
    return cls(message, response=response, body=None)


def test_classify_exceptions():
    request = httpx.Request("POST", "http://gw")
    cases = [
        (RewardError("no judge"), StopReason.REWARD_ERROR),
        (openai.APIConnectionError(request=request), StopReason.INFRA_ERROR),
        (openai.APITimeoutError(request=request), StopReason.INFRA_ERROR),
        (status_error(openai.InternalServerError, 500, "boom"), StopReason.INFRA_ERROR),
        (status_error(openai.ConflictError, 409, "episode closed"), StopReason.INFRA_ERROR),
        (status_error(openai.AuthenticationError, 401, "wrong key"), StopReason.INFRA_ERROR),
        (status_error(openai.BadRequestError, 400, "max_model_len is 512"), StopReason.LENGTH),
        (status_error(openai.BadRequestError, 400, "its max_turns (3)"), StopReason.MAX_TURNS),
        (status_error(openai.BadRequestError, 400, "top_p must be"), StopReason.TOOL_ERROR),
        (status_error(openai.NotFoundError, 404, "model"), StopReason.TOOL_ERROR),
        (EngineUnavailable("down"), StopReason.INFRA_ERROR),
        (KeyError("x"), StopReason.TOOL_ERROR),
    ]
    assert [classify(exc) for exc, _ in cases] == [reason for _, reason in cases]


def test_training_row_splits_at_the_first_sampled_token():
    sample = BranchSequence(
        [1, 2, 3, 4, 5, 6], [0, 0, 1, 0, 1, 1], [0, 0, -1, 0, -2, -3], [-1, -1, 4, -1, 5, 5], 0
    )
    row = training_row(sample)
    assert row == {
        "prompt_ids": [1, 2],
        "completion_ids": [3, 4, 5, 6],
        "completion_mask": [1, 0, 1, 1],
        "logprobs": [-1, 0, -2, -3],
        "versions": [4, -1, 5, 5],
    }


def test_timeout_inside_the_rollout_is_not_the_episode_timeout(scripted):
    engine, url = scripted

    async def own_timeout(task, llm):
        raise TimeoutError("my tool timed out")

    outcome = run(run_episode, url, own_timeout, {}, episode_timeout_s=30)
    assert outcome.stop_reason == StopReason.TOOL_ERROR and "my tool" in outcome.error


def test_close_refuses_a_nan_reward(tokenizer):
    with TestClient(make_app(ScriptedEngine(tokenizer)), raise_server_exceptions=False) as client:
        episode = open_episode(client)
        url = f"/episodes/{episode['episode_id']}/close"
        bad = client.post(url, headers=ADMIN, content=b'{"reward": NaN}')
        assert bad.status_code == 422
        unknown_reason = client.post(url, headers=ADMIN, json={"stop_reason": "bored"})
        assert unknown_reason.status_code == 422
        assert client.post(url, headers=ADMIN, json={"reward": None}).status_code == 200


def test_n_choices_are_branches_and_the_chosen_one_is_continued(tokenizer):
    engine = ScriptedEngine(tokenizer, ["yes", "no", "fine"])
    with TestClient(make_app(engine), raise_server_exceptions=False) as client:
        episode = open_episode(client)
        user = [{"role": "user", "content": "Hi"}]
        both = chat(client, episode, user, n=2).json()
        assert [c["message"]["content"] for c in both["choices"]] == ["yes", "no"]
        follow = user + [
            {"role": "assistant", "content": "no"},
            {"role": "user", "content": "Why?"},
        ]
        assert chat(client, episode, follow).status_code == 200
        url = f"/episodes/{episode['episode_id']}/close"
        result = client.post(url, headers=ADMIN, json={"reward": 1.0}).json()
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    first, second = result["samples"]
    assert first["input_ids"] == engine.prompts[0] + engine.char_ids("yes") + eos
    # the continued choice: its exact ids, then the bridge, then the next reply
    no = engine.prompts[0] + engine.char_ids("no") + eos
    assert second["input_ids"][: len(no)] == no and engine.prompts[1][: len(no)] == no
    assert second["input_ids"] == engine.prompts[1] + engine.char_ids("fine") + eos
    assert result["metrics"]["branches"] == 2 and result["metrics"]["turns"] == 3


@pytest.mark.parametrize(
    "value, reward, reason",
    [
        (1, 1.0, StopReason.OK),
        (Result(0.5, "length"), 0.5, StopReason.LENGTH),
        (Result(None, "tool_error"), None, StopReason.TOOL_ERROR),
        (Result(None), None, StopReason.REWARD_ERROR),
        (float("nan"), None, StopReason.REWARD_ERROR),
        (None, None, StopReason.REWARD_ERROR),
        ("1.0", 1.0, StopReason.OK),
        (True, None, StopReason.REWARD_ERROR),
        (Result(1.0, "bored"), None, StopReason.REWARD_ERROR),
        ({"reward": 1}, None, StopReason.REWARD_ERROR),
    ],
)
def test_rollout_return_values(value, reward, reason):
    got, why, *_ = _unpack(value)
    assert (got, why) == (reward, reason)


def test_official_client_streams_a_tool_call(scripted):
    engine, url = scripted
    engine.replies.extend([CALL])

    async def rollout(task, llm):
        async with llm.client() as oai:
            stream = await oai.chat.completions.create(
                model=llm.model,
                messages=[{"role": "user", "content": "2 + 3?"}],
                tools=[ADD_TOOL],
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
        [call] = chunks[0].choices[0].delta.tool_calls
        assert (call.index, call.function.name) == (0, "add")
        assert chunks[0].choices[0].finish_reason == "tool_calls"
        assert chunks[-1].usage.completion_tokens == len(engine.char_ids(CALL)) + 1
        return 1.0

    outcome = run(run_episode, url, rollout, {})
    assert outcome.stop_reason == StopReason.OK and outcome.metrics.tool_calls == 1
