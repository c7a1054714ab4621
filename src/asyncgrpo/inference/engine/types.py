"""The engine's public vocabulary: what a request asks for and what comes back.

The HTTP server, the benchmarks and the tests talk to the embedded engine only
through these types (and the `Engine` methods documented in `engine.py`), so
they stay independent of how batching and the KV cache are implemented.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

# Bounds on one request's sampling settings. vLLM bounds only top_logprobs; the
# others are ours: a million stop strings are checked against every sampled
# token, and a seed or top_k past int64 overflows inside the sampler.
MAX_TEMPERATURE = 100.0  # logits / 100 is already uniform for any practical purpose
MAX_TOP_K = 2**31 - 1  # anything above the vocabulary means "no top-k"
MAX_SEED = 2**63  # exclusive: seed + sample index must stay a valid torch seed
MAX_TOP_LOGPROBS = 20
MAX_PROMPT_LOGPROBS = 20  # top-k per prompt position (vLLM's default max_logprobs)
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


class RequestError(Exception):
    """A request the engine refuses, inside its server; `status` is the HTTP status it maps
    to, `param` the request field at fault (reported as the OpenAI error's `param`). A client
    sees the answer as `engine_errors.EngineRefused` or `EngineUnavailable`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


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
    # None: no prompt log-probs; k >= 0: every prompt token's log-prob plus the k most
    # likely tokens at each position, under the raw model distribution (see PromptLogprobs)
    prompt_logprobs: int | None = None

    def validate(self) -> None:
        """Refuse (400, naming the field) any value the sampler cannot honour exactly."""
        _require(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _require(
            math.isfinite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
            "temperature",
            f"must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature}",
        )
        _require(
            math.isfinite(self.top_p) and 0 < self.top_p <= 1,
            "top_p",
            f"must be a number in (0, 1], got {self.top_p}",
        )
        _require(
            -1 <= self.top_k <= MAX_TOP_K,
            "top_k",
            f"must be -1 or 0 (off) or in [1, {MAX_TOP_K}], got {self.top_k}",
        )
        _require(
            self.seed is None or 0 <= self.seed < MAX_SEED,
            "seed",
            f"must be in [0, 2**63), got {self.seed}",
        )
        _require(self.n >= 1, "n", f"must be >= 1, got {self.n}")
        _require(
            0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
            "top_logprobs",
            f"must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs}",
        )
        _require(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_PROMPT_LOGPROBS,
            "prompt_logprobs",
            f"must be null or between 0 and {MAX_PROMPT_LOGPROBS}, got {self.prompt_logprobs}",
        )
        self._validate_stops()

    def _validate_stops(self) -> None:
        _require(
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}",
        )
        _require(
            all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
            "stop",
            f"each stop string must be at most {MAX_STOP_STRING_CHARS} characters",
        )
        _require(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"at most {MAX_STOP_TOKEN_IDS} stop token ids are allowed, "
            f"got {len(self.stop_token_ids)}",
        )


def _require(ok: bool, param: str, problem: str) -> None:
    if not ok:
        raise RequestError(f"{param} {problem}", 400, param)


@dataclass
class PromptLogprobs:
    """Log-probs of a prompt's tokens, each given the tokens before it.

    Entry i is about prompt token i + 1 (the first token has no context): `logprobs[i]`
    is its log-probability, `ranks[i]` its rank in the vocabulary (1 = most likely; the
    number of tokens at least as likely, itself included, as vLLM counts), and `top[i]`
    the k most likely `(token_id, logprob)`, most likely first. The distribution is the
    RAW model's (temperature 1, no top-k or top-p), whatever the request samples with:
    what a trainer's forward at temperature 1 computes.
    """

    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]]


@dataclass
class TokenDelta:
    """New tokens of one sample (`index` in 0..n-1) since its previous delta.

    `logprobs[i]` is the log-probability of `token_ids[i]` under the distribution
    it was actually sampled from (after temperature, top-k and top-p);
    `versions[i]` is the weight version that sampled it. `top_logprobs[i]` lists
    `(token_id, logprob)` alternatives when requested. A delta with
    `finish_reason` set is the last one for that index: "stop" (EOS, stop token
    or stop string), "length" (max_tokens or the context limit) or "abort".
    The first delta of each sample of a request that asked for them carries the
    prompt's `prompt_logprobs` (the same object for all `n` samples).
    """

    index: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    prompt_logprobs: PromptLogprobs | None = None
