"""The engine's public vocabulary: what a request asks for and what comes back.

The HTTP server, the benchmarks and the tests talk to the embedded engine only
through these types (and the `Engine` methods documented in `engine.py`), so
they stay independent of how batching and the KV cache are implemented.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class EngineError(Exception):
    """A request the engine refuses; `status` is the HTTP status it maps to."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status


class PauseMode(str, Enum):
    """How a pause treats requests in flight (same names as vLLM's `/pause`)."""

    KEEP = "keep"  # freeze them in place; they continue after `resume`
    ABORT = "abort"  # end them now with finish_reason "abort" and their partial output
    WAIT = "wait"  # stop admitting new work, return once the running ones finish


@dataclass
class SamplingParams:
    """Per-request sampling settings (OpenAI names; `top_k <= 0` disables top-k)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    top_logprobs: int = 0  # how many alternatives to report per token (0 = none)

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise EngineError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise EngineError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise EngineError("top_p must be in (0, 1]")
        if self.n < 1:
            raise EngineError("n must be >= 1")
        if not 0 <= self.top_logprobs <= 20:
            raise EngineError("top_logprobs must be between 0 and 20")


@dataclass
class TokenDelta:
    """New tokens of one sample (`index` in 0..n-1) since its previous delta.

    `logprobs[i]` is the log-probability of `token_ids[i]` under the distribution
    it was actually sampled from (after temperature, top-k and top-p);
    `versions[i]` is the weight version that sampled it. `top_logprobs[i]` lists
    `(token_id, logprob)` alternatives when requested. A delta with
    `finish_reason` set is the last one for that index: "stop" (EOS, stop token
    or stop string), "length" (max_tokens or the context limit) or "abort".
    """

    index: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
