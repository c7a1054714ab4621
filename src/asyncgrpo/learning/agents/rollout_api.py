"""What a rollout function sees and returns: its endpoint (`LLM`), `Result` and `RewardError`.

The contract user code is written against (`from asyncgrpo.learning.agents import
LLM, Result`), kept apart from the episode machinery in `runner`.
"""

from __future__ import annotations

import contextlib
import functools
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from asyncgrpo.base.episode import StopReason


@dataclass(frozen=True)
class LLM:
    """The per-episode endpoint a rollout talks to (an OpenAI-compatible base URL and key)."""

    base_url: str
    api_key: str
    model: str
    call_timeout_s: float | None = None  # per call; the SDK retries it (the gateway dedupes)
    max_retries: int = 2

    def client(self, **kwargs: Any):
        """An `openai.AsyncOpenAI` for this episode (close it, e.g. `async with llm.client()`).

        Its HTTP client is the SDK's default one, but on the process's TLS context
        (`tls_context`): the SDK would build a context per client, loading the CA bundle
        each time, about 25 ms of CPU per episode even for a plain-HTTP endpoint."""
        import openai

        if self.call_timeout_s is not None:
            kwargs.setdefault("timeout", self.call_timeout_s)
        kwargs.setdefault("max_retries", self.max_retries)
        if kwargs.get("http_client") is None:
            kwargs["http_client"] = openai.DefaultAsyncHttpxClient(verify=tls_context())
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The TLS context every `LLM.client()` of this process shares: httpx's default (the CA
    bundle of `SSL_CERT_FILE` or `SSL_CERT_DIR` where set, else certifi's), built once."""
    import httpx

    if hasattr(httpx, "create_ssl_context"):
        return httpx.create_ssl_context()
    import certifi  # httpx < 0.28 has no public builder; its default is certifi's bundle

    return ssl.create_default_context(cafile=certifi.where())


@dataclass
class Result:
    """What a rollout may return instead of a bare reward."""

    reward: float | None
    stop_reason: StopReason | str = StopReason.OK
    tool_failures: int = 0
    info: dict[str, Any] = field(default_factory=dict)  # anything to log with the episode
    context: Any = None
    """What a group scorer reads after the episode (its environment, its conversation):
    handed to `GroupScorer.score` as `EpisodeOutcome.context`, never logged."""


class EnvironmentFailure(Exception):
    """The environment (a server, an environment object) failed, not the policy: the episode
    ends as `infra_error` and is run again, never scored 0."""


class RewardError(Exception):
    """The reward could not be computed: the episode is masked (`reward_error`), not scored 0."""


@contextlib.contextmanager
def reward_scope():
    """Any exception inside becomes a `RewardError` (so it is masked, not a `tool_error`)."""
    try:
        yield
    except RewardError:
        raise
    except Exception as exc:
        raise RewardError(f"reward computation failed: {type(exc).__name__}: {exc}") from exc


RolloutFn = Callable[[dict, LLM], Awaitable["float | Result"]]
