"""The episode gateway: one private OpenAI endpoint per agent episode, every call recorded.

An agent is ordinary OpenAI-client code; it is given a base URL
`/e/{episode_id}/v1` and an API key that belong to one episode. Each chat
completion it makes there is prefilled with `next_prompt_ids` (the episode's
exact tokens plus the rendered new messages, never re-tokenized history),
sampled like `/v1/chat/completions`, and recorded as a `Call` in the episode's
`TrajectoryBuilder`. Closing the episode (an admin route) returns the training
samples and frees it.

Security. The episode routes need the episode's key (`Authorization: Bearer`,
compared in constant time). An unknown episode and a wrong key both get 401,
so a caller cannot probe which ids exist; a closed or expired episode gets 409
only when the right key is shown (its id and a hash of its key are kept as a
bounded tombstone; once evicted, the answer is 401). The admin routes
(open, close, inspect) need the admin token like the other control routes.

SDK retries. The openai SDK resends the same body after a timeout or a 5xx,
with `x-stainless-retry-count` > 0. Such a request whose body (canonical JSON,
hashed) matches an earlier one of the episode gets that request's response,
awaiting it if it is still running, and nothing is recorded twice. A retry
whose original failed runs afresh. A turn runs as a task of its own, so a
client that gives up does not cancel it: its retry finds it. One lock per
episode orders the turns (prompt, generation, record); turns of one episode do
not run concurrently.

Bounds: at most `max_open_episodes` open episodes (503 beyond); an episode idle
for `episode_idle_timeout_s` is closed (expired) when the registry next looks;
at most `max_turns` calls per episode (400 beyond, counted as `refused_turns`).
A call's body is checked like a `/v1/chat/completions` body before it becomes a
turn, and its prompt is rendered and tokenized off the event loop. Streaming is
served from the finished response (see `openai_format.chunks_of`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import time
from collections import Counter, OrderedDict
from dataclasses import asdict

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from asyncgrpo.inference.engine.types import RequestError
from asyncgrpo.inference.server import openai_routes, prompts
from asyncgrpo.inference.server.control_routes import require_admin
from asyncgrpo.inference.server.protocol import ChatCompletionRequest, RequestLimits
from asyncgrpo.inference.server.trajectory import Call, EpisodeResult, StopReason, TrajectoryBuilder

RETRY_HEADER = "x-stainless-retry-count"
REPLAY_CAPACITY = 64  # responses remembered per episode for SDK retries


class ReplayCache:
    """Body hash -> the task answering it (running or done), the newest `capacity` kept."""

    def __init__(self, capacity: int = REPLAY_CAPACITY):
        self.capacity = capacity
        self._tasks: OrderedDict[str, asyncio.Future] = OrderedDict()

    def get(self, digest: str) -> asyncio.Future | None:
        task = self._tasks.get(digest)
        if task is None or (task.done() and (task.cancelled() or task.exception())):
            return None  # a failed original: the retry must run afresh
        return task

    def put(self, digest: str, task: asyncio.Future) -> None:
        self._tasks[digest] = task
        self._tasks.move_to_end(digest)
        while len(self._tasks) > self.capacity:
            self._tasks.popitem(last=False)


def body_digest(raw: bytes) -> str:
    """Hash of the request body as canonical JSON (key order and spacing do not matter)."""
    try:
        canonical = json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":"))
    except ValueError:
        return hashlib.sha256(raw).hexdigest()
    return hashlib.sha256(canonical.encode()).hexdigest()


def retry_count(request: Request) -> int:
    try:
        return int(request.headers.get(RETRY_HEADER, "0"))
    except ValueError:
        return 0


def _key_hash(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Episode:
    """One open episode: its key, its trajectory, its replay cache and its turn lock."""

    def __init__(self, tokenizer, max_turns: int, now: float):
        self.id = secrets.token_urlsafe(16)
        self.key = secrets.token_urlsafe(32)
        self.builder = TrajectoryBuilder(tokenizer)
        self.max_turns = max_turns
        self.created = self.last_used = now
        self.closed = False
        self.lock = asyncio.Lock()
        self.replays = ReplayCache()
        self.tasks: set[asyncio.Task] = set()
        self.active = 0  # requests being served; an active episode never expires
        self.deduped_retries = 0
        self.refused_turns = 0

    def info(self, now: float) -> dict:
        calls = self.builder.calls
        return {
            "episode_id": self.id,
            "state": "closed" if self.closed else "open",
            "turns": len(calls),
            "max_turns": self.max_turns,
            "refused_turns": self.refused_turns,
            "deduped_retries": self.deduped_retries,
            "in_flight": sum(not t.done() for t in self.tasks),
            "branches": len(self.builder.branches),
            "tool_calls": sum(len((c.reply or {}).get("tool_calls") or []) for c in calls),
            "malformed_tool_calls": sum(c.malformed_tool_calls for c in calls),
            "age_s": now - self.created,
            "idle_s": now - self.last_used,
        }


class EpisodeRegistry:
    """The open episodes of a server, with their bound, idle expiry and tombstones."""

    def __init__(
        self,
        max_open: int = 1024,
        idle_timeout_s: float = 900.0,
        max_turns: int = 1000,
        clock=time.monotonic,
        max_tombstones: int | None = None,
    ):
        self.max_open = max_open
        self.idle_timeout_s = idle_timeout_s
        self.max_turns = max_turns
        self.clock = clock
        self.max_tombstones = max_tombstones or max(4096, 4 * max_open)
        self.open: dict[str, Episode] = {}
        self.tombstones: OrderedDict[str, bytes] = OrderedDict()  # closed id -> key hash
        self.counts: Counter[str] = Counter()

    def create(self, tokenizer, max_turns: int | None = None) -> Episode:
        self.expire_idle()
        if len(self.open) >= self.max_open:
            self.counts["refused"] += 1
            raise RequestError(
                f"too many open episodes ({self.max_open}); close finished ones "
                "or raise max_open_episodes",
                503,
            )
        turns = self.max_turns if max_turns is None else min(max_turns, self.max_turns)
        episode = Episode(tokenizer, turns, self.clock())
        self.open[episode.id] = episode
        self.counts["opened"] += 1
        return episode

    def authorize(self, episode_id: str, authorization: str) -> Episode:
        """The open episode this key belongs to; 401 for anything else, 409 if it was closed."""
        self.expire_idle()
        scheme, _, key = authorization.partition(" ")
        key = key.strip() if scheme.lower() == "bearer" else ""
        episode = self.open.get(episode_id)
        if episode is not None and secrets.compare_digest(key.encode(), episode.key.encode()):
            episode.last_used = self.clock()
            return episode
        known = self.tombstones.get(episode_id)
        if known is not None and secrets.compare_digest(_key_hash(key), known):
            raise RequestError(f"episode {episode_id} is closed", 409)
        raise RequestError("unknown episode or wrong API key", 401)

    def lookup(self, episode_id: str) -> Episode:
        """For admin routes: the open episode, 409 if closed, 404 if unknown."""
        self.expire_idle()
        if episode_id in self.open:
            return self.open[episode_id]
        if episode_id in self.tombstones:
            raise RequestError(f"episode {episode_id} is closed", 409)
        raise RequestError(f"no episode {episode_id}", 404)

    def retire(self, episode: Episode, why: str = "closed") -> None:
        """Refuse further calls; the id stays known (tombstone) so its key gets 409."""
        episode.closed = True
        self.open.pop(episode.id, None)
        self.tombstones[episode.id] = _key_hash(episode.key)
        while len(self.tombstones) > self.max_tombstones:
            self.tombstones.popitem(last=False)
        self.counts[why] += 1

    def expire_idle(self) -> list[Episode]:
        now = self.clock()
        idle = [
            e
            for e in self.open.values()
            if e.active == 0
            and all(t.done() for t in e.tasks)
            and now - e.last_used > self.idle_timeout_s
        ]
        for episode in idle:
            self.retire(episode, "expired")
            episode.builder = TrajectoryBuilder(None)  # free the recorded tokens
        return idle

    def stats(self) -> dict:
        return {"open": len(self.open), "max_open": self.max_open, **self.counts}


# ---- admin routes ----

admin_router = APIRouter(dependencies=[Depends(require_admin)])


class OpenRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_turns: int | None = Field(default=None, ge=1)


class CloseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: float | None = Field(default=None, allow_inf_nan=False)
    stop_reason: StopReason = StopReason.OK
    tool_failures: int = Field(default=0, ge=0)


def result_to_dict(result: EpisodeResult) -> dict:
    return {
        "reward": result.reward,
        "stop_reason": result.stop_reason.value,
        "samples": [asdict(s) for s in result.samples],
        "metrics": asdict(result.metrics),
    }


@admin_router.get("/episodes")
async def episode_stats(request: Request):
    return request.app.state.episodes.stats()


@admin_router.post("/episodes")
async def open_episode(request: Request, body: OpenRequest | None = None):
    registry: EpisodeRegistry = request.app.state.episodes
    episode = registry.create(request.app.state.engine.tokenizer, (body or OpenRequest()).max_turns)
    path = f"/e/{episode.id}/v1"
    host = request.headers.get("host")
    return {
        "episode_id": episode.id,
        "base_path": path,
        "base_url": f"{str(request.base_url).rstrip('/')}{path}" if host else path,
        "api_key": episode.key,
        "model": openai_routes.served_name(request),
        "max_turns": episode.max_turns,
    }


@admin_router.get("/episodes/{episode_id}")
async def episode_info(episode_id: str, request: Request):
    registry: EpisodeRegistry = request.app.state.episodes
    return registry.lookup(episode_id).info(registry.clock())


@admin_router.post("/episodes/{episode_id}/close")
async def close_episode(episode_id: str, body: CloseRequest, request: Request):
    """Refuse further calls, cancel a call still running, return the samples; frees the episode."""
    registry: EpisodeRegistry = request.app.state.episodes
    episode = registry.lookup(episode_id)
    registry.retire(episode)
    for task in episode.tasks:
        task.cancel()
    await asyncio.gather(*episode.tasks, return_exceptions=True)
    async with episode.lock:
        result = episode.builder.result(body.reward, body.stop_reason, body.tool_failures)
    info = episode.info(registry.clock())
    episode.builder = TrajectoryBuilder(None)
    return {
        "episode_id": episode.id,
        **result_to_dict(result),
        "refused_turns": info["refused_turns"],
        "deduped_retries": info["deduped_retries"],
    }


# ---- the episode's own OpenAI routes ----

router = APIRouter()


def authorized(episode_id: str, request: Request) -> Episode:
    registry: EpisodeRegistry = request.app.state.episodes
    return registry.authorize(episode_id, request.headers.get("authorization", ""))


@router.get("/e/{episode_id}/v1/models")
async def episode_models(episode_id: str, request: Request):
    authorized(episode_id, request)
    return await openai_routes.models(request)


@router.post("/e/{episode_id}/v1/chat/completions")
async def episode_chat(episode_id: str, request: Request):
    episode = authorized(episode_id, request)
    episode.active += 1
    try:
        raw = await request.body()
        body = parse_chat_body(raw)
        openai_routes.check_model(request, body.model)
        body.check(RequestLimits.of(request.app.state.engine))
        digest = body_digest(raw)
        task = episode.replays.get(digest) if retry_count(request) > 0 else None
        if task is not None:
            episode.deduped_retries += 1
        else:
            task = asyncio.ensure_future(run_turn(request, episode, body))
            episode.tasks.add(task)
            task.add_done_callback(episode.tasks.discard)
            episode.replays.put(digest, task)
        await asyncio.wait({task})  # a cancelled handler leaves the turn running for its retry
        if task.cancelled():
            raise RequestError(f"episode {episode_id} was closed during the call", 409)
        response = task.result()
    finally:
        episode.active -= 1
        episode.last_used = request.app.state.episodes.clock()
    return openai_routes.stream_of(response, body.include_usage) if body.stream else response


def parse_chat_body(raw: bytes) -> ChatCompletionRequest:
    """Parsed as the OpenAI routes parse theirs (`json.loads`, which keeps a lone surrogate
    for the checks to refuse with a 400 that names it)."""
    try:
        data = json.loads(raw)
    except ValueError as exc:  # also a body that is not UTF-8; a 422 as FastAPI's routes give
        error = {"type": "json_invalid", "loc": ("body",), "msg": f"JSON decode error: {exc}"}
        raise RequestValidationError([error]) from None
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


async def run_turn(request: Request, episode: Episode, body: ChatCompletionRequest) -> dict:
    """Prompt from the episode's exact tokens, sample, record each choice; in turn order."""
    engine = request.app.state.engine
    async with episode.lock:
        if episode.closed:
            raise RequestError(f"episode {episode.id} is closed", 409)
        if len(episode.builder.calls) >= episode.max_turns:
            episode.refused_turns += 1
            raise RequestError(f"episode reached its max_turns ({episode.max_turns})", 400)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        prompt = await prompts.off_loop(
            prompts.episode_prompt_ids,
            episode.builder,
            messages,
            engine.tokenizer,
            body,
            RequestLimits.of(engine),
        )
        job = openai_routes.chat_job(engine, body, prompt)
        choices = await job.run()
        if episode.closed:
            raise RequestError(f"episode {episode.id} is closed", 409)
        parsed = [
            openai_routes.parse_tool_calls(request, body, c.text.text, f"{job.id}-{c.index}")
            for c in choices
        ]
        response = openai_routes.chat_response(request, body, job, choices, prompt, parsed)
        for c, choice, found in zip(choices, response["choices"], parsed):
            episode.builder.add(
                Call(
                    messages=messages,
                    prompt_ids=prompt,
                    completion_ids=c.token_ids,
                    logprobs=c.logprobs,
                    versions=c.versions,
                    finish_reason=c.finish_reason or "stop",
                    reply=choice["message"],
                    tools=body.tools,
                    chat_template_kwargs=body.chat_template_kwargs,
                    malformed_tool_calls=found.malformed if found else 0,
                )
            )
        return response
