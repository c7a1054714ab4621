"""The orchestrator's only way to reach an inference engine: an async HTTP client.

It speaks the engine protocol — OpenAI routes plus vLLM's RL
control routes — so the same client drives the embedded engine and a vLLM
server. Generation goes through `/v1/completions` with token-id prompts and
`return_token_ids`, so training never re-tokenizes text; every sample comes back
with its sampled token ids, their log-probs and the weight version of each
token (`-1` where a server does not report versions).

One pooled `httpx.AsyncClient` per client; `base_url` may be changed when an
engine restarts on another address. Retries follow `retry.RetryPolicy`.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from asyncgrpo.base.engine_errors import EngineProtocolError, EngineUnavailable
from asyncgrpo.inference.client.episodes import EpisodeGatewayMixin
from asyncgrpo.inference.client.retry import RetryPolicy, send_with_retry

UNKNOWN_VERSION = -1


@dataclass
class Continuation:
    """One sampled continuation: ids, their log-probs and the weight version of each token."""

    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    finish_reason: str | None
    text: str = ""
    stop_reason: str | int | None = None


@dataclass
class Completion:
    """The `n` samples of one prompt, plus the prompt's token ids as the engine saw them.

    With `complete(prompt_logprobs=k)`: `prompt_logprobs[i]` is the log-prob of prompt
    token i given tokens 0..i-1 (None for i = 0) under the raw model distribution
    (temperature 1, no top-k/top-p, whatever the sampling settings), and, for k > 0,
    `prompt_top_logprobs[i]` the k most likely `(token_id, logprob)` there, most likely
    first (None for i = 0). Both None when not asked for (`prompt_top_logprobs` also for k = 0).
    """

    samples: list[Continuation]
    prompt_token_ids: list[int]
    id: str = ""
    usage: dict = field(default_factory=dict)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None


class EngineClient(EpisodeGatewayMixin):
    """Async client for one engine server (embedded or vLLM); episode routes come from the mixin."""

    def __init__(
        self,
        base_url: str,
        admin_token: str | None = None,
        retry: RetryPolicy | None = None,
        *,
        model: str | None = None,
        timeout: float = 600.0,
        max_connections: int = 256,
    ):
        self.base_url = base_url
        self.admin_token = admin_token
        self.retry = retry or RetryPolicy()
        self.model = model
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=10.0),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=min(64, max_connections)
            ),
        )

    @property
    def base_url(self) -> str:
        return self._base_url

    @base_url.setter
    def base_url(self, value: str) -> None:
        self._base_url = value.rstrip("/")

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # ---- plumbing ------------------------------------------------------------------

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict | None = None,
        admin: bool = False,
        content: Callable[[], AsyncIterator[bytes]] | None = None,
        headers: dict | None = None,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        """Send one call with retries; `content` is a factory so a retry can resend the body."""
        headers = dict(headers or {})
        if admin and self.admin_token:
            headers["Authorization"] = f"Bearer {self.admin_token}"
        extra = {} if timeout is None else {"timeout": timeout}

        async def send() -> httpx.Response:
            body = {"content": content()} if content is not None else {"json": json}
            return await self._http.request(
                method, self.base_url + path, params=params, headers=headers, **body, **extra
            )

        return await send_with_retry(send, retry or self.retry, f"{method} {path}")

    async def _json(self, method: str, path: str, **kw) -> Any:
        response = await self.request(method, path, **kw)
        return response.json() if response.content else {}

    # ---- generation ------------------------------------------------------------------

    async def complete(
        self,
        prompt_ids: list[int],
        *,
        n: int = 1,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
        prompt_logprobs: int | None = None,
        timeout: float | None = None,
    ) -> Completion:
        """Sample `n` continuations of a token-id prompt (`/v1/completions`).

        `prompt_logprobs=k` (vLLM's field) also scores the prompt: see `Completion`.
        """
        body = {
            "prompt": list(prompt_ids),
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "logprobs": 0,
            "return_token_ids": True,
            "ignore_eos": ignore_eos,
        }
        body.update(
            _optional(
                seed=seed,
                stop=stop,
                stop_token_ids=stop_token_ids,
                model=self.model,
                prompt_logprobs=prompt_logprobs,
            )
        )
        data = await self._json("POST", "/v1/completions", json=body, timeout=timeout)
        completion = _completion(data, prompt_ids)
        if prompt_logprobs is not None:
            first = min(data["choices"], key=lambda c: c["index"]) if data["choices"] else {}
            add_prompt_logprobs(completion, first.get("prompt_logprobs"), prompt_logprobs)
        return completion

    async def chat(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        n: int = 1,
        max_tokens: int | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: list[str] | None = None,
        timeout: float | None = None,
        **extra: Any,
    ) -> Completion:
        """A chat completion (`/v1/chat/completions`) with token ids, log-probs and versions."""
        body = {
            "messages": messages,
            "n": n,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "logprobs": True,
            "return_token_ids": True,
            **extra,
        }
        body.update(
            _optional(tools=tools, max_tokens=max_tokens, seed=seed, stop=stop, model=self.model)
        )
        data = await self._json("POST", "/v1/chat/completions", json=body, timeout=timeout)
        return _chat_completion(data)

    # ---- health and information ----------------------------------------------------------

    async def health(self) -> bool:
        try:
            response = await self._http.get(self.base_url + "/health", timeout=5.0)
        except httpx.TransportError:
            return False
        return response.status_code == 200

    async def wait_until_healthy(self, timeout: float = 300.0, poll: float = 0.25) -> None:
        """Poll `/health` until it answers 200; `EngineUnavailable` after `timeout` s."""
        import asyncio

        deadline = time.monotonic() + timeout
        while not await self.health():
            if time.monotonic() >= deadline:
                raise EngineUnavailable(
                    f"engine at {self.base_url} not healthy within {timeout:.0f}s"
                )
            await asyncio.sleep(poll)

    async def models(self) -> list[dict]:
        return (await self._json("GET", "/v1/models"))["data"]

    async def server_info(self) -> dict:
        return await self._json("GET", "/server_info", admin=True)

    async def get_world_size(self) -> int:
        return int((await self._json("GET", "/get_world_size", admin=True))["world_size"])

    # ---- control --------------------------------------------------------------------------

    async def pause(self, mode: str = "keep") -> None:
        """Pause generation: "keep" freezes requests in flight, "abort" ends them, "wait" drains."""
        await self.request(
            "POST", "/pause", params={"mode": str(getattr(mode, "value", mode))}, admin=True
        )

    async def resume(self) -> None:
        await self.request("POST", "/resume", admin=True)

    async def is_paused(self) -> bool:
        return bool((await self._json("GET", "/is_paused", admin=True))["is_paused"])

    async def abort_requests(self) -> int:
        """Abort every request in flight; returns how many there were."""
        return int((await self._json("POST", "/abort_requests", admin=True)).get("aborted", 0))

    async def reset_prefix_cache(self) -> None:
        await self.request("POST", "/reset_prefix_cache", admin=True)

    # ---- the four-step weight update (the transports call these) ----------------------------

    async def init_weight_transfer_engine(self, backend: str, **info: Any) -> None:
        await self.request(
            "POST",
            "/init_weight_transfer_engine",
            json={"init_info": {"backend": backend, **info}},
            admin=True,
        )

    async def start_weight_update(self) -> None:
        await self.request(
            "POST", "/start_weight_update", json={"is_checkpoint_format": True}, admin=True
        )

    async def update_weights(self, update_info: dict) -> None:
        await self.request("POST", "/update_weights", json={"update_info": update_info}, admin=True)

    async def update_weights_bytes(
        self, body: Callable[[], AsyncIterator[bytes]], size: int
    ) -> None:
        """Send a safetensors image as the request body (the `http` backend)."""
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        await self.request("POST", "/update_weights", content=body, headers=headers, admin=True)

    async def finish_weight_update(self, version: int) -> None:
        await self.request(
            "POST", "/finish_weight_update", json={"weight_version": version}, admin=True
        )

    async def weight_version(self) -> int:
        return int((await self._json("GET", "/weight_info", admin=True))["weight_version"])


def _optional(**values: Any) -> dict:
    return {k: v for k, v in values.items() if v is not None}


def _completion(data: dict, prompt_ids: list[int]) -> Completion:
    """A `/v1/completions` answer; the prompt ids sent stand in if the server echoes none."""
    choices = sorted(data["choices"], key=lambda c: c["index"])
    samples = [
        _sample(c, (c.get("logprobs") or {}).get("token_logprobs"), c.get("text", ""))
        for c in choices
    ]
    prompt = data.get("prompt_token_ids") or (
        choices[0].get("prompt_token_ids") if choices else None
    )
    return Completion(
        samples, list(prompt or prompt_ids), data.get("id", ""), data.get("usage", {})
    )


def add_prompt_logprobs(completion: Completion, positions: list | None, top_k: int) -> None:
    """Parse vLLM's `prompt_logprobs` (None, then per position a dict token id ->
    {logprob, rank, decoded_token} holding the prompt token and the top-k) into `completion`.
    Both `/v1/completions` and vLLM's `/inference/v1/generate` answer in this form."""
    prompt = completion.prompt_token_ids
    if positions is None or len(positions) != len(prompt):
        raise EngineProtocolError(
            f"asked for prompt_logprobs of a {len(prompt)}-token prompt, got "
            f"{'none' if positions is None else len(positions)}"
        )
    logprobs: list[float | None] = [None]
    tops: list[list[tuple[int, float]] | None] = [None]
    for token, position in zip(prompt[1:], positions[1:], strict=True):
        entry = (position or {}).get(str(token))
        if entry is None:
            raise EngineProtocolError(f"prompt_logprobs lack prompt token {token}")
        logprobs.append(float(entry["logprob"]))
        ranked = sorted(position.items(), key=lambda item: item[1].get("rank") or math.inf)
        ranked = ranked[:top_k]
        tops.append([(int(t), float(e["logprob"])) for t, e in ranked])
    completion.prompt_logprobs = logprobs
    completion.prompt_top_logprobs = tops if top_k > 0 else None


def _chat_completion(data: dict) -> Completion:
    """A `/v1/chat/completions` answer (log-probs per token under `logprobs.content`)."""
    choices = sorted(data["choices"], key=lambda c: c["index"])
    samples = []
    for c in choices:
        content = (c.get("logprobs") or {}).get("content")
        logprobs = None if content is None else [entry["logprob"] for entry in content]
        samples.append(_sample(c, logprobs, (c.get("message") or {}).get("content") or ""))
    return Completion(
        samples,
        list(data.get("prompt_token_ids") or []),
        data.get("id", ""),
        data.get("usage", {}),
    )


def _sample(choice: dict, logprobs: list[float] | None, text: str) -> Continuation:
    token_ids = choice.get("token_ids")
    if token_ids is None or logprobs is None:
        raise EngineProtocolError(
            "the server returned no token_ids/logprobs (is it an RL-capable engine?)"
        )
    versions = choice.get("weight_versions")
    if versions is None:
        versions = [UNKNOWN_VERSION] * len(token_ids)
    if not len(token_ids) == len(logprobs) == len(versions):
        raise EngineProtocolError(
            f"choice {choice.get('index')}: {len(token_ids)} token ids, {len(logprobs)} log-probs "
            f"and {len(versions)} versions"
        )
    return Continuation(
        list(token_ids),
        [float(x) for x in logprobs],
        [int(v) for v in versions],
        choice.get("finish_reason"),
        text,
        choice.get("stop_reason"),
    )
