"""Bounded retries for engine calls, and the two errors a caller must tell apart.

An engine can be briefly unreachable (starting, restarting, overloaded) and the
orchestrator should ride that out; but a request the engine refuses (a prompt
longer than the context, a bad parameter) will be refused again, and retrying
it forever is how other RL stacks hang their rollout workers. So:

- connection errors, timeouts and 5xx answers are retried with exponential
  backoff, up to `max_attempts` and never past `deadline` seconds;
- a 4xx answer raises `EngineRefused` at once, carrying the server's message;
- when retries run out, `EngineUnavailable` says what the last failure was.

`deadline` bounds the retrying, not one attempt: a long generation is governed
by the client's per-request timeout, a separate knob.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from asyncgrpo.base.engine_errors import EngineRefused, EngineUnavailable


@dataclass
class RetryPolicy:
    """How long and how often to retry a call that failed for a transient reason."""

    deadline: float = 60.0
    """Seconds after the first attempt past which no new attempt starts."""
    max_attempts: int = 10
    """Attempts in total (1 = no retry)."""
    base_backoff: float = 0.1
    """Sleep before the second attempt; doubles after every failure."""
    max_backoff: float = 5.0
    """Longest sleep between two attempts."""

    def backoff(self, failures: int) -> float:
        """Sleep after `failures` failed attempts: capped exponential with ±25% jitter."""
        delay = min(self.max_backoff, self.base_backoff * 2 ** (failures - 1))
        return delay * random.uniform(0.75, 1.25)


def server_message(response: httpx.Response) -> str:
    """The error text of an OpenAI/vLLM/FastAPI-style error body, or the raw body."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:2000] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if body.get(key):
                return str(body[key])
    return str(body)[:2000]


async def send_with_retry(
    send: Callable[[], Awaitable[httpx.Response]], policy: RetryPolicy, what: str
) -> httpx.Response:
    """Call `send` until it returns a non-5xx response, within `policy`.

    Returns 2xx/3xx responses; raises `EngineRefused` on 4xx and
    `EngineUnavailable` when the attempts or the deadline run out.
    """
    start = time.monotonic()
    attempts = 0
    while True:
        attempts += 1
        status = None
        try:
            response = await send()
        except httpx.TransportError as exc:  # connect/read/write errors and timeouts
            last = f"{type(exc).__name__}: {exc}".rstrip(": ")
        else:
            if response.status_code < 400:
                return response
            message = server_message(response)
            if response.status_code < 500:
                raise EngineRefused(response.status_code, message)
            status, last = response.status_code, f"HTTP {response.status_code}: {message}"
        remaining = policy.deadline - (time.monotonic() - start)
        if attempts >= policy.max_attempts or remaining <= 0:
            raise EngineUnavailable(
                f"{what} failed after {attempts} attempt(s) in "
                f"{time.monotonic() - start:.1f}s; last error: {last}",
                status,
                attempts,
            )
        await asyncio.sleep(min(policy.backoff(attempts), remaining))
