"""A vLLM server as the engine behind asyncgrpo's HTTP server (`asyncgrpo serve` with
`engine.upstream_url`).

The OpenAI routes and the agent episode gateway run unchanged in front of vLLM:
they render chat templates and parse tool calls themselves and hand this engine
token ids, which it sends to vLLM's token-in/token-out route (`POST
/inference/v1/generate`, enabled by `--enable-scale-out`). An episode therefore
records exactly the tokens vLLM sampled, with vLLM's log-probs and, per token,
the weight version that sampled it (vLLM's version spans, expanded).
Only the tokenizer and the model config are loaded here, never the weights.
Stop strings and stop tokens are matched by vLLM, which, like the embedded
engine, keeps every sampled token up to the one that completes the stop (the
server cuts the text). The request body is `generate_request.generate_request`'s,
as the trainer's `VLLMClient`'s: each request is salted with vLLM's current
weight label (read from `/weight_info` just before), so no prompt prefix cached
under older weights is reused: the prefix-cache reset at a sync does nothing
while requests are running (vLLM refuses it then), and agents' requests often are.

Where this departs from the embedded engine:
- A request's tokens arrive in one piece when vLLM finishes it: vLLM reports
  which version sampled which token only on the finished output.
- Top log-probs: vLLM lists the sampled token first, then candidates, cut at the
  number asked for; one more is asked for and the list is re-ranked, so a
  request for `k` gets vLLM's top `k` (at most vLLM's `max_logprobs` are asked).
- A per-request `seed` is refused (400) unless vLLM runs on an accelerator: on
  a CPU it kills vLLM's engine (vLLM 0.32's CPU backend, once the prompt is
  prefilled in chunks).
- Pausing and weight updates belong to vLLM itself (the trainer drives them
  there); the control routes refuse them on a gateway.
- A consumer that goes away cancels the HTTP request to vLLM; the closed
  connection makes vLLM abort it (measured: a cancelled 64 x 1000-token request
  stopped at the ~2,400 tokens it had). `/abort_requests` on the gateway aborts
  its requests through vLLM's `/inference/v1/abort_requests`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.base.engine_errors import EngineProtocolError
from asyncgrpo.inference.engine.engine import Engine
from asyncgrpo.inference.engine.types import RequestError, SamplingParams, TokenDelta
from asyncgrpo.inference.vllm.client import sample_from_choice
from asyncgrpo.inference.vllm.generate_request import (
    GENERATE_PATH,
    generate_request,
    seeds_are_safe,
)

logger = logging.getLogger(__name__)

ABORT = "/inference/v1/abort_requests"
WEIGHT_INFO = "/weight_info"
ENGINE_ID_PREFIX = "generate-tokens-"  # vLLM's engine-side id of a generate request: prefix + ours
TIMEOUT = httpx.Timeout(10.0, read=None)  # a generation may run as long as it needs


@dataclass(frozen=True)
class Upstream:
    """What the gateway learns from the vLLM server once, at start."""

    url: str
    max_model_len: int
    dtype: str  # e.g. "torch.bfloat16"; "unknown" without /server_info
    device: str | None  # "cpu", "cuda", ...; None: unknown (/server_info needs dev mode)
    max_logprobs: int
    labelled: bool  # /weight_info answers (dev mode): weights can change, requests are salted

    @property
    def seeds_are_safe(self) -> bool:
        return seeds_are_safe(self.device)


class RemoteEngine:
    """The part of `Engine` the server routes use, generating on the vLLM server at
    `config.upstream_url`. `transport` replaces the network (tests)."""

    def __init__(self, config: EmbeddedEngineConfig, transport: httpx.BaseTransport | None = None):
        from transformers import AutoConfig, AutoTokenizer

        if not config.upstream_url or not config.model:
            raise RequestError("RemoteEngine needs engine.upstream_url and engine.model", 500)
        self.config = config
        self.model_name = config.model
        self.upstream_url = config.upstream_url.rstrip("/")
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self.vocab_size = int(AutoConfig.from_pretrained(config.model).vocab_size)
        with httpx.Client(transport=transport, timeout=TIMEOUT) as http:
            self.upstream = probe_upstream(http, self.upstream_url)
        self.max_model_len = _context_limit(config, self.upstream)
        self.dtype = self.upstream.dtype
        # one connection per running request; the server's own connection limit bounds them
        limits = httpx.Limits(max_connections=config.max_connections)
        self._http = httpx.AsyncClient(transport=transport, timeout=TIMEOUT, limits=limits)
        self._live: set[str] = set()  # our request ids with a request running upstream
        self._aborts: set[asyncio.Task] = set()
        self._running = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.counts = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0}

    # ---- lifecycle (the app's lifespan) ----------------------------------------

    def start(self) -> None:
        """Serve; called on the event loop that will run the requests (the app's lifespan)."""
        self._loop = asyncio.get_running_loop()
        self._running = True

    def shutdown(self) -> None:
        """Stop taking requests and close the connections to vLLM (from a worker thread, as
        the app's lifespan calls it, while the loop still runs)."""
        self._running = False
        loop, self._loop = self._loop, None
        if loop is not None and loop.is_running():
            closed = asyncio.run_coroutine_threadsafe(self._http.aclose(), loop)
            closed.result(timeout=10)

    def is_alive(self) -> bool:
        """True while the gateway serves; vLLM's own health is vLLM's /health."""
        return self._running

    def stats(self) -> dict:
        return {"upstream_url": self.upstream_url, "running": len(self._live), **self.counts}

    # ---- generation --------------------------------------------------------------

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The embedded engine's checks, and no seed for a vLLM that dies of one."""
        Engine.check_request(self, prompt_ids, params)
        if params.prompt_logprobs is not None:  # not forwarded: refused, not dropped
            raise RequestError(
                "prompt_logprobs is not supported by a gateway to vLLM; ask the vLLM server "
                f"at {self.upstream_url} directly",
                400,
                "prompt_logprobs",
            )
        if params.seed is not None and not self.upstream.seeds_are_safe:
            raise RequestError(
                f"seed is not supported: the vLLM server at {self.upstream_url} runs on "
                f"{self.upstream.device or 'an unknown device'}, and a per-request seed "
                "kills vLLM's CPU engine",
                400,
                "seed",
            )

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[TokenDelta]:
        """One delta per sample, each with all its tokens, once vLLM finishes the request."""
        self.check_request(prompt_ids, params)
        rid = request_id or f"gateway-{uuid.uuid4().hex}"
        body = generate_request(
            prompt_ids,
            params,
            send_seed=self.upstream.seeds_are_safe,
            weight_label=await self._weight_label() if self.upstream.labelled else None,
            max_logprobs=self.upstream.max_logprobs,
            request_id=rid,
        )
        self._live.add(rid)
        try:
            data = await self._post_generate(body)
        finally:
            self._live.discard(rid)
        self.counts["requests"] += 1
        self.counts["prompt_tokens"] += len(prompt_ids)
        for choice in data.get("choices") or []:
            delta = token_delta(choice, params.top_logprobs)
            self.counts["generated_tokens"] += len(delta.token_ids)
            yield delta

    def abort_all(self) -> int:
        """Abort every request this gateway has running on vLLM; each ends with "abort"."""
        live = sorted(self._live)
        self._abort_upstream(live)
        return len(live)

    async def _weight_label(self) -> str:
        """vLLM's label of the weights it samples with now (what salts the request)."""
        response = await self._send("GET", WEIGHT_INFO)
        if response.status_code != 200:
            raise upstream_error(response, self.upstream_url)
        label = _json_object(response).get("weight_version")
        if label is None:
            raise RequestError(f"vLLM at {self.upstream_url}: /weight_info has no version", 502)
        return str(label)

    async def _post_generate(self, body: dict) -> dict:
        response = await self._send("POST", GENERATE_PATH, json=body)
        if response.status_code != 200:
            raise upstream_error(response, self.upstream_url)
        return response.json()

    async def _send(self, method: str, path: str, **kwargs) -> httpx.Response:
        """One request to vLLM, sent again once if a pooled connection turns out dead (vLLM
        drops its connection after answering 500); 503 when vLLM cannot be reached."""
        url = self.upstream_url + path
        try:
            return await self._http.request(method, url, **kwargs)
        except httpx.RemoteProtocolError:
            pass  # the server closed the connection without answering: try a new one
        except httpx.TransportError as exc:
            raise unreachable(self.upstream_url, exc) from None
        try:
            return await self._http.request(method, url, **kwargs)
        except httpx.TransportError as exc:
            raise unreachable(self.upstream_url, exc) from None

    def _abort_upstream(self, request_ids: list[str]) -> None:
        """Ask vLLM to abort these requests, in the background (the caller is synchronous)."""
        if not request_ids:
            return
        task = asyncio.ensure_future(self._post_abort(request_ids))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _post_abort(self, request_ids: list[str]) -> None:
        body = {"request_ids": [ENGINE_ID_PREFIX + rid for rid in request_ids]}
        try:
            response = await self._http.post(self.upstream_url + ABORT, json=body)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            logger.warning(
                "could not abort %s on vLLM at %s: %s", request_ids, self.upstream_url, exc
            )


# ---- the upstream at start -----------------------------------------------------------


def probe_upstream(http: httpx.Client, url: str) -> Upstream:
    """Read vLLM's limits and check it serves what the gateway needs; RequestError if not."""
    try:
        models = http.get(url + "/v1/models")
        info = http.get(url + "/server_info", params={"config_format": "json"})
        generate = http.get(url + GENERATE_PATH)  # 405 (POST only) once the route exists, else 404
        labelled = http.get(url + WEIGHT_INFO).status_code == 200
    except httpx.TransportError as exc:
        raise unreachable(url, exc) from None
    try:
        max_model_len = int(models.json()["data"][0]["max_model_len"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise RequestError(
            f"{url} is not a vLLM server: GET /v1/models answered {models.status_code} "
            "without a model's max_model_len",
            503,
        ) from None
    if generate.status_code == 404:
        raise RequestError(
            f"vLLM at {url} has no {GENERATE_PATH} route: start it with --enable-scale-out", 503
        )
    config = _json_object(info).get("vllm_config") or {}  # needs VLLM_SERVER_DEV_MODE=1
    model = config.get("model_config") or {}
    mode = model.get("logprobs_mode", "processed_logprobs")
    if mode != "processed_logprobs":
        raise RequestError(
            f"vLLM at {url} reports logprobs_mode {mode}: start it with --logprobs-mode "
            "processed_logprobs (the loss needs the log-probs of the distribution sampled from)",
            503,
        )
    return Upstream(
        url=url,
        max_model_len=max_model_len,
        dtype=str(model.get("dtype", "unknown")),
        device=(config.get("device_config") or {}).get("device"),
        max_logprobs=int(model.get("max_logprobs", 20)),
        labelled=labelled,
    )


def _json_object(response: httpx.Response) -> dict:
    """The body of a 200 answer if it is a JSON object, else {}."""
    try:
        data = response.json() if response.status_code == 200 else {}
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _context_limit(config: EmbeddedEngineConfig, upstream: Upstream) -> int:
    if config.max_model_len and config.max_model_len > upstream.max_model_len:
        raise RequestError(
            f"max_model_len={config.max_model_len} exceeds the vLLM server's "
            f"max_model_len={upstream.max_model_len}",
            500,
        )
    return config.max_model_len or upstream.max_model_len


# ---- request and response mapping ------------------------------------------------------


def token_delta(choice: dict, top_logprobs: int) -> TokenDelta:
    """A finished vLLM choice as the embedded engine's last delta of that sample, with one
    weight version per token ("default", vLLM's initial weights, is version 0)."""
    try:
        sample = sample_from_choice(choice)
    except (EngineProtocolError, KeyError, TypeError, ValueError) as exc:
        raise RequestError(f"vLLM's answer breaks its protocol: {exc}", 502) from None
    content = choice["logprobs"]["content"]
    return TokenDelta(
        index=int(choice["index"]),
        token_ids=sample.token_ids,
        logprobs=sample.logprobs,
        versions=sample.weight_versions,
        top_logprobs=[ranked(e.get("top_logprobs") or [], top_logprobs) for e in content]
        if top_logprobs
        else None,
        finish_reason=sample.finish_reason or "stop",
        stop_reason=sample.stop_reason,
    )


def ranked(candidates: list[dict], count: int) -> list[tuple[int, float]]:
    """The `count` best (token id, log-prob) pairs, best first, from vLLM's list (which puts
    the sampled token first whatever its rank)."""
    ranks = sorted(
        (c["rank"], int(c["token_id"]), float(c["logprob"]))
        for c in candidates
        if c.get("rank") is not None and c["rank"] <= count
    )
    return [(token, logprob) for _, token, logprob in ranks]


# ---- errors ------------------------------------------------------------------------------


def unreachable(url: str, exc: Exception) -> RequestError:
    return RequestError(f"vLLM at {url} is unreachable: {type(exc).__name__}: {exc}", 503)


def upstream_error(response: httpx.Response, url: str) -> RequestError:
    """vLLM's refusal as ours: a 4xx keeps its status and message; a 5xx is a 502 (503 as is)."""
    message, param = _error_fields(response)
    status = response.status_code
    if status < 500:
        return RequestError(message, status, param)
    return RequestError(
        f"vLLM at {url} failed ({status}): {message}", 503 if status == 503 else 502
    )


def _error_fields(response: httpx.Response) -> tuple[str, str | None]:
    """(message, param) of vLLM's OpenAI-shaped error, or of a plain FastAPI one."""
    try:
        data = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase, None
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", "")), error.get("param")
    detail = data.get("detail") if isinstance(data, dict) else None
    return str(detail if detail is not None else data)[:500], None
