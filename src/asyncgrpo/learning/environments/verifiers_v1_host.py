"""Where a verifiers 0.4 environment lives during a run: its own event loop, and a relay.

A 0.4 `Env` serves its episodes from resources it holds for a whole evaluation
(`Env.serving()`: the interception servers its agents' model calls go through, the
taskset's shared MCP tool servers). `EnvHost` holds them on an event loop of its own thread
for the run, so nothing of verifiers (aiohttp servers, AnyIO scopes, tool processes) runs on
asyncgrpo's rollout loop; an episode is submitted there and awaited, and cancelling the
wait cancels the episode. `close` leaves `serving()` (tool servers stop), closes the
in-process harness's model clients of that loop, and stops the thread.

The relay. verifiers' interception forwards each model call to the endpoint of the run's
client config, building one HTTP client per distinct config for as long as it serves. Every
asyncgrpo episode has its own gateway URL and key, so a config per episode would leave a
client behind per episode. Instead every episode shares one config, pointing at a
loopback relay here; verifiers sends each call with the rollout's trace id
(`X-Session-ID`), and the relay forwards it to the gateway of the episode that trace
belongs to (traces are registered the moment verifiers mints them, before any call), with
that episode's key. An unknown trace id is refused (401). Streamed answers stream through.

Every call that reaches an episode's gateway is trained. A seat its environment marks
untrainable (`agents.user.trainable = False`: a simulated user, a judge) that calls the
policy's endpoint is refused (403, logged): it must have an endpoint of its own
(`AgentConfig.client`), or its tokens would train as the policy's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

from asyncgrpo.base.loop_thread import LoopThread
from asyncgrpo.learning.agents.rollout_api import LLM

SESSION_HEADER = "X-Session-ID"  # verifiers' per-rollout routing header (its trace id)
FORWARDED_HEADERS = ("x-stainless-retry-count", "idempotency-key")
START_TIMEOUT_S = 300.0  # shared tool servers start (and set up) before the first episode
UNTRAINABLE = (
    "the environment marked this seat untrainable, but it calls the policy's endpoint, where "
    "every call is trained: give the seat an endpoint of its own (AgentConfig.client)"
)

logger = logging.getLogger(__name__)


class Relay:
    """Loopback endpoint forwarding verifiers' model calls to their episode's gateway."""

    def __init__(self) -> None:
        self.routes: dict[str, LLM | None] = {}  # trace id -> its gateway (None: untrainable)
        self.url = ""
        self._warned = False
        self._http: Any = None  # the aiohttp client session to the gateways, while serving

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[Relay]:
        import aiohttp  # verifiers 0.4's own HTTP library: its server, and a lighter client
        from aiohttp import web

        app = web.Application(client_max_size=1024**3)
        app.router.add_post("/v1/{tail:.*}", self._forward)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        site = web.SockSite(runner, sock)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0)
        connector = aiohttp.TCPConnector(limit=0)  # as many connections as calls in flight
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            self._http = http
            try:
                await site.start()
                self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
                yield self
            finally:
                await runner.cleanup()
                self._http = None

    async def _forward(self, request: Any) -> Any:
        import aiohttp
        from aiohttp import web

        trace_id = request.headers.get(SESSION_HEADER, "")
        if trace_id not in self.routes:
            return web.json_response({"error": {"message": "unknown rollout"}}, status=401)
        llm = self.routes[trace_id]
        if llm is None:
            if not self._warned:
                self._warned = True
                logger.warning("verifiers environment: %s", UNTRAINABLE)
            return web.json_response({"error": {"message": UNTRAINABLE}}, status=403)
        headers = {"Authorization": f"Bearer {llm.api_key}", "Content-Type": "application/json"}
        headers.update({k: request.headers[k] for k in FORWARDED_HEADERS if k in request.headers})
        target = f"{llm.base_url.rstrip('/')}/{request.match_info['tail']}"
        try:
            upstream = await self._http.post(target, data=await request.read(), headers=headers)
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            return web.json_response({"error": {"message": repr(exc)}}, status=504)
        except aiohttp.ClientError as exc:
            return web.json_response({"error": {"message": repr(exc)}}, status=503)
        async with upstream:  # released (its connection reused) once answered
            return await self._answer(request, upstream)

    @staticmethod
    async def _answer(request: Any, upstream: Any) -> Any:
        """The gateway's answer, as it came (a stream streams through)."""
        from aiohttp import web

        kind = upstream.headers.get("Content-Type", "application/json")
        if not kind.startswith("text/event-stream"):
            body = await upstream.read()
            return web.Response(body=body, status=upstream.status, content_type=None,
                                headers={"Content-Type": kind})  # fmt: skip
        reply = web.StreamResponse(status=upstream.status, headers={"Content-Type": kind})
        await reply.prepare(request)
        async for chunk in upstream.content.iter_any():
            await reply.write(chunk)
        await reply.write_eof()
        return reply


class EnvHost:
    """A verifiers `Env` serving on its own loop for the run (see the module docstring)."""

    def __init__(self, env: Any, model_context: Any):
        """`model_context(relay_url, model)`: the verifiers `ModelContext` of an episode."""
        self.env = env
        self.relay = Relay()
        self._model_context = model_context
        self._thread = LoopThread("asyncgrpo-verifiers")
        self._stop: asyncio.Event | None = None
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._held = self._thread.submit(self._hold(ready))
        try:
            ready.result(START_TIMEOUT_S)
        except BaseException:
            self._held.cancel()
            self._thread.stop()
            raise

    async def _hold(self, ready: concurrent.futures.Future) -> None:
        from asyncgrpo.learning.environments.verifiers_harness import close_clients

        self._stop = asyncio.Event()
        try:
            async with self.relay.serving(), self.env.serving():
                ready.set_result(None)
                await self._stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise
        finally:
            await close_clients()  # the harness's model clients on this loop

    async def episode(self, task: Any, llm: LLM) -> Any:
        """One verifiers episode of `task` against `llm`'s gateway (awaited from any loop)."""
        future = self._thread.submit(self._episode(task, llm))
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()
            raise

    async def _episode(self, task: Any, llm: LLM) -> Any:
        minted: list[str] = []

        def route(trace: Any) -> None:  # at the trace's mint, before any model call
            trainable = trace.agent is None or trace.agent.trainable
            self.relay.routes[trace.id] = llm if trainable else None
            minted.append(trace.id)

        try:
            context = self._model_context(self.relay.url, llm.model)
            return await self.env.run_episode(task, context, on_trace=route)
        finally:
            for trace_id in minted:
                self.relay.routes.pop(trace_id, None)

    def close(self, timeout: float = 60.0) -> None:
        """Leave `serving()` (the tool servers stop) and stop the thread; idempotent."""
        if self._stop is not None and not self._held.done():
            self._thread.loop.call_soon_threadsafe(self._stop.set)
            with contextlib.suppress(Exception):
                self._held.result(timeout)
        self._thread.stop()
