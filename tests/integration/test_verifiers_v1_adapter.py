"""The verifiers 0.4 adapter's decisions, on verifiers' own records and loaders (no engine):
how an episode's end becomes its stop reason, what the reward columns are, which
environments and settings are refused and how, and that an environment installed as a
package (`pip install ./examples/verifiers_warehouse`, offline) loads by its module name.
"""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import subprocess
import sys
import textwrap

import pytest
from verifiers_v1_support import ENVS, REPO, importable, requires_verifiers_04

from asyncgrpo.base.config import ConfigError, RunConfig
from asyncgrpo.base.episode import StopReason
from asyncgrpo.learning.agents.rollout_api import EnvironmentFailure, RewardError

pytestmark = requires_verifiers_04


def episode(*, stop="agent_completed", error=None, calls=(), episode_error=None):
    """A one-trace verifiers Episode as `Env.run_episode` leaves it."""
    import verifiers.v1 as vf

    data = vf.TaskData(prompt="x")
    trace = vf.Trace(
        task=vf.TraceTask(type="T", data=data), agent=vf.AgentInfo(config=vf.AgentConfig())
    )
    trace.calls = list(calls)
    trace.record_reward("right", 1.0, 0.5)
    trace.record_metric("turns_taken", 2)
    if error is not None:
        trace.record_error(error)
    elif stop.endswith("_timeout"):
        trace.record_timeout(stop.removesuffix("_timeout"))
    else:
        trace.stop(stop)
    trace.ok = error is None
    out = vf.Episode(env=vf.EnvInfo(id="t"), task=trace.task, traces=[trace])
    if episode_error is not None:
        out.errors.append(vf.Error(type=type(episode_error).__name__, message=str(episode_error)))
    return out


def test_how_a_verifiers_episode_ended_becomes_its_stop_reason():
    import verifiers.v1 as vf

    from asyncgrpo.learning.environments.verifiers_v1_episodes import ending

    done = ending(episode())
    assert done.stop_reason == StopReason.OK and done.reward is None  # the scorer's
    assert done.info == {"metric_turns_taken": 2.0, "score_right": 1.0}
    assert ending(episode(stop="max_turns")).stop_reason == StopReason.MAX_TURNS
    assert ending(episode(stop="max_output_tokens")).stop_reason == StopReason.LENGTH
    cut = [vf.ModelCall(finish_reason="length")]
    assert ending(episode(calls=cut)).stop_reason == StopReason.LENGTH
    refused = [vf.ModelCall(error=vf.Error(type="ProviderError", message="", status_code=413))]
    assert ending(episode(calls=refused)).stop_reason == StopReason.LENGTH
    assert ending(episode(stop="agent_timeout")).stop_reason == StopReason.TIMEOUT

    def failed(error):
        return ending(episode(error=error)).stop_reason

    assert failed(vf.ProviderError("upstream 413", status_code=413)) == StopReason.LENGTH
    assert failed(vf.ProviderError("max_turns=2 reached", status_code=400)) == (
        StopReason.MAX_TURNS
    )
    assert failed(vf.ProviderError("bad role", status_code=400)) == StopReason.TOOL_ERROR
    for infra in (
        vf.ProviderError("engine down", status_code=503),  # the gateway's own failure
        vf.ProviderError("episode expired", status_code=409),
        vf.TaskError("task setup: ConnectionResetError: gone"),
        vf.ToolsetError("building tool servers: OSError: no port"),
        vf.HarnessError("harness 'asyncgrpo-chat': RuntimeError: broke"),
        vf.SandboxError("runtime died"),
    ):
        with pytest.raises(EnvironmentFailure, match=re.escape(str(infra))):
            failed(infra)
    with pytest.raises(RewardError, match="scoring"):
        failed(vf.TaskError("task T scoring: ValueError: no"))
    with pytest.raises(EnvironmentFailure, match="EnvError"):
        ending(episode(episode_error=vf.EnvError("TalkEnv.run(): KeyError: 'x'")))


def test_reward_columns_are_the_declared_functions_and_nothing_else():
    import asyncio

    import verifiers.v1 as vf

    from asyncgrpo.learning.environments.verifiers_v1_episodes import V1Rewards

    scorer = V1Rewards(["right", "short"])
    outcome = type("Outcome", (), {"context": episode()})
    assert asyncio.run(scorer.score({}, [outcome])) == [[1.0, None]]  # `short` unrecorded
    stray = episode()
    stray.traces[0].rewards["bonus"] = vf.Reward(score=1.0)  # e.g. an Env.finalize's own
    with pytest.raises(ValueError, match=r"rewards \['bonus'\] were recorded"):
        scorer.columns(stray)


def source(section: dict, **agent):
    from asyncgrpo.learning.environments import episode_source

    cfg = RunConfig.model_validate({"agent": {"verifiers": section, **agent}})
    return cfg, episode_source(cfg)


def write(folder, name: str, text: str) -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(text))


def test_environments_that_cannot_run_are_refused_before_the_engine_starts(tmp_path, monkeypatch):
    importable(monkeypatch, ENVS, tmp_path)
    with pytest.raises(ConfigError, match="taskset 'no-such-env' not found.*pip install"):
        source({"id": "no-such-env"})
    write(tmp_path, "classic_env", "def load_environment(**kwargs):\n    return None\n")
    with pytest.raises(ConfigError, match="classic-API environment.*verifiers 0.3.x"):
        source({"id": "classic-env"})
    with pytest.raises(ConfigError, match="dotted path; verifiers 0.4 imports .* package's name"):
        source({"id": "examples.verifiers_word_budget"})  # the classic example, by its path
    write(
        tmp_path,
        "endless_env",
        """
        import itertools
        import verifiers.v1 as vf
        class Endless(vf.Taskset):
            INFINITE = True
            def load(self):
                return (vf.Task(vf.TaskData(prompt=str(i))) for i in itertools.count())
        __all__ = ["Endless"]
    """,
    )
    with pytest.raises(ConfigError, match="never ends.*agent.verifiers.num_tasks"):
        source({"id": "endless-env"})
    with pytest.raises(ConfigError, match="declares no reward"):
        source({"id": "endless-env", "num_tasks": 3})
    write(
        tmp_path,
        "hot_env",
        """
        import verifiers.v1 as vf
        from vf_talk import TalkTaskset
        class HotConfig(vf.SingleAgentEnvConfig):
            agent: vf.AgentConfig = vf.AgentConfig(sampling=vf.SamplingConfig(temperature=0.3))
        class HotEnv(vf.Env[HotConfig]):
            async def run(self, task, agents):
                await agents.agent.run(task)
        __all__ = ["HotEnv", "TalkTaskset"]
    """,
    )
    with pytest.raises(ConfigError, match=r"seat 'agent' pins sampling \['temperature'\]"):
        source({"id": "hot-env"})
    with pytest.raises(ConfigError, match="agent.verifiers: args.num_taskz: Extra inputs"):
        source({"id": "vf_talk", "args": {"num_taskz": 3}})


def test_a_run_sets_each_seat_and_weighs_the_columns_as_the_environment_does(monkeypatch):
    importable(monkeypatch, ENVS)
    section = {"id": "vf-lookup", "args": {"num_tasks": 3}, "eval_args": {"num_tasks": 2}}
    cfg, src = source(section, max_turns=3)
    try:
        seat = src.rollout.host.env.config.agent
        assert seat.harness.id == "asyncgrpo-chat" and seat.runtime.type == "subprocess"
        assert seat.max_turns == 3
        assert src.scorer.names == ["looked", "reply_length"]
        assert cfg.advantage.reward_weights == [1.0, 0.5]  # the @vf.reward weights
        assert [r["verifiers_task"] for r in src.train_rows] == [0, 1, 2]
        assert [r["verifiers_task"] for r in src.eval_rows] == [3, 4]
        assert src.train_rows[1]["prompt"] == "What is 1 + 1? Use the look tool."
        # a recipe's own dataset row is the task's data
        task = src.rollout.book.task_of({"prompt": "hi", "values": {"a": "b"}})
        assert task.data.values == {"a": "b"} and task.data.prompt == "hi"
    finally:
        for close in src.closers:
            close()


INSTALLED_CHECK = """
import json
from asyncgrpo.base.config import RunConfig
from asyncgrpo.learning.environments import episode_source
cfg = RunConfig.model_validate({"agent": {"verifiers": {
    "id": "verifiers-warehouse", "args": {"num_tasks": 5}, "eval_args": {"seed": 1},
    "num_eval_tasks": 4}}})
src = episode_source(cfg)
try:
    env = src.rollout.host.env
    print(json.dumps({"module": type(env.taskset).__module__, "names": src.scorer.names,
                      "weights": cfg.advantage.reward_weights, "train": len(src.train_rows),
                      "held_out": len(src.eval_rows)}))
finally:
    src.closers[0]()
"""


def test_an_installed_environment_package_loads_by_its_module_name_offline(tmp_path):
    if importlib.util.find_spec("hatchling") is None:
        pytest.skip("the package's build backend (hatchling) is not installed")
    site = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    install += ["--no-build-isolation", "--target", str(site)]
    subprocess.run([*install, str(REPO / "examples" / "verifiers_warehouse")], check=True)
    assert (site / "verifiers_warehouse" / "servers" / "stock.py").exists()
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", INSTALLED_CHECK], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded == {
        "module": "verifiers_warehouse.taskset",
        "names": ["asked_right_item", "stated_count"],
        "weights": [0.5, 1.0],
        "train": 5,
        "held_out": 4,
    }


def test_the_relay_sends_each_trace_to_its_own_episode_and_refuses_the_rest():
    import asyncio

    import httpx
    from aiohttp import web

    from asyncgrpo.learning.agents.rollout_api import LLM
    from asyncgrpo.learning.environments.verifiers_v1_host import Relay

    async def gateway(request):  # answers with what it was sent
        body = await request.json()
        return web.json_response(
            {"path": request.path, "key": request.headers["Authorization"], **body}
        )

    async def exchange():
        app = web.Application()
        app.router.add_post("/e/{episode}/v1/chat/completions", gateway)
        runner = web.AppRunner(app)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        port = sock.getsockname()[1]
        relay = Relay()
        async with relay.serving(), httpx.AsyncClient() as http:
            for episode in ("one", "two"):
                base = f"http://127.0.0.1:{port}/e/{episode}/v1"
                relay.routes[f"trace-{episode}"] = LLM(base, f"key-{episode}", "m")
            relay.routes["trace-user"] = None  # a seat its environment marked untrainable

            async def post(trace_id):
                reply = await http.post(
                    f"{relay.url}/chat/completions",
                    json={"model": "m"},
                    headers={"X-Session-ID": trace_id},
                )
                return reply.status_code, reply.json()

            replies = [await post(t) for t in ("trace-two", "trace-one", "nope", "trace-user")]
        await runner.cleanup()
        return replies

    two, one, unknown, untrainable = asyncio.run(exchange())
    assert two == (
        200,
        {"path": "/e/two/v1/chat/completions", "key": "Bearer key-two", "model": "m"},
    )
    assert one[1]["path"] == "/e/one/v1/chat/completions" and one[1]["key"] == "Bearer key-one"
    assert unknown[0] == 401
    assert untrainable[0] == 403 and "AgentConfig.client" in untrainable[1]["error"]["message"]


def test_the_harness_keeps_one_client_per_endpoint_and_each_call_carries_its_rollouts_secret():
    import asyncio

    import verifiers.v1 as vf
    from aiohttp import web

    from asyncgrpo.learning.environments.verifiers_harness import (
        InProcessChatConfig,
        InProcessChatHarness,
        ToolBelt,
        close_clients,
        converse,
    )

    calls = []  # (the secret a call carried, the connection it came on)
    reply = {
        "id": "c",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant"}}],
    }

    async def interception(request):
        calls.append(
            (request.headers["Authorization"], request.transport.get_extra_info("peername"))
        )
        return web.json_response({**reply, "choices": [{**reply["choices"][0]}]})

    async def two_segments():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", interception)
        runner = web.AppRunner(app)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        harness = InProcessChatHarness(InProcessChatConfig(call_timeout_s=30))
        task = vf.TraceTask(type="T", data=vf.TaskData(prompt="x"))
        trace = vf.Trace(task=task, agent=vf.AgentInfo(config=vf.AgentConfig()))
        clients = []
        for secret in ("rollout-a", "rollout-b"):
            clients.append(harness.model_client(endpoint))
            messages = [{"role": "user", "content": "x"}]
            await converse(clients[-1], "m", messages, ToolBelt(), trace, secret)
        await close_clients()  # as the env's host does when it stops
        await runner.cleanup()
        return clients

    first, second = asyncio.run(two_segments())
    assert first is second and first.is_closed()
    assert [secret for secret, _ in calls] == ["Bearer rollout-a", "Bearer rollout-b"]
    assert calls[0][1] == calls[1][1]  # one connection, kept open between the segments


def test_the_relay_streams_a_streamed_answer_through_and_reports_an_unreachable_gateway():
    import asyncio

    import httpx
    from aiohttp import web

    from asyncgrpo.learning.agents.rollout_api import LLM
    from asyncgrpo.learning.environments.verifiers_v1_host import Relay

    events = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]

    async def gateway(request):  # a streamed chat completion, event by event
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        for event in events:
            await reply.write(event)
            await asyncio.sleep(0.01)
        await reply.write_eof()
        return reply

    async def exchange():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", gateway)
        runner = web.AppRunner(app)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: nothing answers there
        relay = Relay()
        async with relay.serving(), httpx.AsyncClient() as http:
            relay.routes["live"] = LLM(f"http://127.0.0.1:{sock.getsockname()[1]}/v1", "k", "m")
            relay.routes["gone"] = LLM(f"http://127.0.0.1:{closed.getsockname()[1]}/v1", "k", "m")
            url = f"{relay.url}/chat/completions"
            async with http.stream(
                "POST", url, json={"stream": True}, headers={"X-Session-ID": "live"}
            ) as streamed:
                kind = streamed.headers["content-type"]
                chunks = [chunk async for chunk in streamed.aiter_bytes()]
            gone = await http.post(url, json={}, headers={"X-Session-ID": "gone"})
        closed.close()
        await runner.cleanup()
        return kind, b"".join(chunks), gone.status_code

    kind, body, gone = asyncio.run(exchange())
    assert kind.startswith("text/event-stream") and body == b"".join(events)
    assert gone == 503
