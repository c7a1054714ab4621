"""The Tinker wire format of `asample`: a JSON `SampleRequest` in, a protobuf `SampleResponse` out.

`SamplingClient.sample` (and `compute_logprobs`, a one-token sample with prompt
log-probs) posts the SDK's `SampleRequest` as JSON; since SDK 0.25 the result must be the
protobuf `SampleResponse`, whose sequences the SDK pairs one by one with the
`sample_sequence_ids` of the submission's promise. This module turns the request into a
`SampleCall` the engine can serve, checked against `TinkerLimits` before any token list is
copied, and a finished sample back into the SDK's bytes.

`stop` follows the SDK's `SamplingParams`: absent (`null`) keeps the model's end-of-sequence
token as the only stop; a string or a list of strings or token ids adds stops, EOS kept;
`[]` removes every stop, EOS included, so generation runs to `max_tokens`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from asyncgrpo.tinker.errors import TinkerUserError
from asyncgrpo.tinker.json_wire import read_field, refuse_unknown_keys
from asyncgrpo.tinker.limits import TinkerLimits
from asyncgrpo.tinker.wire import tinker_protobuf

PARAMS = "sampling_params"
TOPK_EMPTY_LOGPROB = -99999.0  # the SDK's `topk_logprobs.MASK_LOGPROB`: an empty top-k cell
_SEED_RANGE = 2**63 - 1  # the hosted server folds any seed into [0, 2**63 - 1)
_UNSERVED = (  # request fields this server refuses when set, with what they would ask for
    ("topk_sample_logprobs", 0, "top-k log-probs of sampled tokens"),
    ("prompt_alt_tokens_k", 0, "alternative prompt-token draws"),
    ("target_prompt_logprobs", None, "log-probs of chosen prompt targets"),
    ("record_stability_info", False, "stability records (stable_reinforce)"),
)


@dataclass(frozen=True)
class SampleCall:
    """A decoded `asample` request."""

    sampling_session_id: str
    seq_id: int
    num_samples: int
    prompt: np.ndarray  # (P,) int64
    max_tokens: int | None  # None: up to the context (`check_sample` resolves it)
    seed: int | None
    stop: tuple[str, ...] | tuple[int, ...] | None  # None: EOS only; (): no stop at all
    temperature: float
    top_k: int  # -1: off
    top_p: float
    prompt_logprobs: bool
    topk_prompt_logprobs: int  # 0: off
    prompt_logprobs_last_n: int | None  # score only the prompt's last n tokens

    @property
    def stop_at_eos(self) -> bool:
        return self.stop != ()

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(s for s in self.stop or () if isinstance(s, str))

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(s for s in self.stop or () if isinstance(s, int))


def decode_sample_request(body: Any, limits: TinkerLimits) -> SampleCall:
    """Decode the SDK's JSON `SampleRequest`, refusing what this server cannot serve."""
    if not isinstance(body, dict):
        raise TinkerUserError("", "the body must be a JSON object (a SampleRequest)")
    session = read_field(body, "sampling_session_id", str, default=None)
    if session is None:
        raise TinkerUserError(
            "sampling_session_id",
            "is required: sample through a sampling session "
            "(create_sampling_client or save_weights_and_get_sampling_client)",
        )
    seq_id = read_field(body, "seq_id", int)
    if seq_id < 0:
        raise TinkerUserError("seq_id", f"must not be negative, got {seq_id}")
    try:
        return _decode_sample(body, session, seq_id, limits)
    except TinkerUserError as exc:
        exc.request_key = (session, seq_id)
        raise


def _decode_sample(body: dict, session: str, seq_id: int, limits: TinkerLimits) -> SampleCall:
    for key, off, what in _UNSERVED:
        if body.get(key) not in (None, off):
            raise TinkerUserError(key, f"asks for {what}: not supported by this server")
    num_samples = read_field(body, "num_samples", int, default=1)
    if not 1 <= num_samples <= limits.max_num_samples:
        raise TinkerUserError(
            "num_samples", f"must be in [1, {limits.max_num_samples}], got {num_samples}"
        )
    prompt = _decode_prompt(body.get("prompt"), limits)
    return SampleCall(
        sampling_session_id=session,
        seq_id=seq_id,
        num_samples=num_samples,
        prompt=prompt,
        **_decode_sampling_params(body.get(PARAMS), limits),
        **_decode_prompt_logprob_options(body, len(prompt), limits),
    )


def _decode_prompt(prompt: Any, limits: TinkerLimits) -> np.ndarray:
    """The prompt's text chunks as one int64 array; any other chunk is refused."""
    chunks = read_field({"prompt": prompt}, "prompt", dict).get("chunks")
    if not isinstance(chunks, list) or not chunks:
        raise TinkerUserError("prompt.chunks", "must be a non-empty list of chunks")
    total = 0
    for j, chunk in enumerate(chunks):
        where = f"prompt.chunks[{j}]"
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise TinkerUserError(
                where,
                f"is a {kind} chunk: not supported, this server takes token ids "
                "(EncodedTextChunk) only",
            )
        tokens = chunk.get("tokens")
        if not isinstance(tokens, list):
            raise TinkerUserError(f"{where}.tokens", "must be a list of token ids")
        total += len(tokens)
        if total > limits.max_tokens_per_datum:  # before a single id is converted
            raise TinkerUserError(
                "prompt", f"has over {limits.max_tokens_per_datum} tokens, this server's limit"
            )
        if not all(type(t) is int and 0 <= t < 2**63 for t in tokens):
            raise TinkerUserError(f"{where}.tokens", "must hold non-negative integer token ids")
    if total == 0:
        raise TinkerUserError("prompt", "holds no tokens")
    return np.array([t for chunk in chunks for t in chunk["tokens"]], dtype=np.int64)


def _decode_sampling_params(params: Any, limits: TinkerLimits) -> dict[str, Any]:
    params = read_field({PARAMS: params}, PARAMS, dict)
    keys = {"max_tokens", "seed", "stop", "temperature", "top_k", "top_p"}
    refuse_unknown_keys(params, keys, PARAMS)
    max_tokens = read_field(params, "max_tokens", int, prefix=PARAMS, default=None)
    if max_tokens is not None and not 1 <= max_tokens <= limits.max_sample_tokens:
        raise TinkerUserError(
            f"{PARAMS}.max_tokens", f"must be in [1, {limits.max_sample_tokens}], got {max_tokens}"
        )
    seed = read_field(params, "seed", int, prefix=PARAMS, default=None)
    temperature = read_field(params, "temperature", float, prefix=PARAMS, default=1.0)
    top_k = read_field(params, "top_k", int, prefix=PARAMS, default=-1)
    top_p = read_field(params, "top_p", float, prefix=PARAMS, default=1.0)
    for name, ok, rule in (
        ("temperature", temperature >= 0, ">= 0 (0 is greedy)"),
        ("top_k", top_k == -1 or top_k >= 1, "-1 (off) or >= 1"),
        ("top_p", 0 < top_p <= 1, "in (0, 1]"),
    ):
        if not ok:
            raise TinkerUserError(f"{PARAMS}.{name}", f"must be {rule}, got {params[name]}")
    return {
        "max_tokens": max_tokens,
        "seed": None if seed is None else seed % _SEED_RANGE,
        "stop": _decode_stop(params.get("stop"), limits),
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
    }


def _decode_stop(stop: Any, limits: TinkerLimits) -> tuple[str, ...] | tuple[int, ...] | None:
    where = f"{PARAMS}.stop"
    if stop is None:
        return None
    entries = [stop] if isinstance(stop, str) else stop
    if not isinstance(entries, list) or len(entries) > limits.max_stop_sequences:
        raise TinkerUserError(
            where, f"must be a string or a list of at most {limits.max_stop_sequences} entries"
        )
    if all(isinstance(s, str) and s for s in entries):
        return tuple(entries)
    if all(type(s) is int and 0 <= s < 2**63 for s in entries):
        return tuple(entries)
    raise TinkerUserError(
        where, "must be a non-empty string, a list of them, or a list of token ids (not mixed)"
    )


def _decode_prompt_logprob_options(body: dict, length: int, limits: TinkerLimits) -> dict:
    wanted = read_field(body, "prompt_logprobs", bool, default=False)
    topk = read_field(body, "topk_prompt_logprobs", int, default=0)
    if not 0 <= topk <= limits.max_topk_logprobs:
        raise TinkerUserError(
            "topk_prompt_logprobs", f"must be in [0, {limits.max_topk_logprobs}], got {topk}"
        )
    last_n = read_field(body, "prompt_logprobs_last_n", int, default=None)
    if last_n is not None:
        if not (wanted or topk):
            raise TinkerUserError("prompt_logprobs_last_n", "needs prompt_logprobs")
        if not 1 <= last_n <= length - 1:
            raise TinkerUserError(
                "prompt_logprobs_last_n", f"must be in [1, len(prompt) - 1 = {length - 1}]"
            )
    return {
        "prompt_logprobs": wanted,
        "topk_prompt_logprobs": topk,
        "prompt_logprobs_last_n": last_n,
    }


def check_sample(call: SampleCall, vocab_size: int, max_length: int) -> SampleCall:
    """Check token ids against the vocabulary and the request against the context.

    Returns the call with `max_tokens` resolved: an absent one becomes the room left in the
    context; prompt plus `max_tokens` over the context is refused, as vLLM refuses it.
    """
    outside = (call.prompt >= vocab_size).nonzero()[0]
    if len(outside):
        at = int(outside[0])
        raise TinkerUserError(
            "prompt",
            f"holds token id {int(call.prompt[at])} at position {at}, outside the "
            f"vocabulary [0, {vocab_size})",
        )
    for token in call.stop_token_ids:
        if token >= vocab_size:
            raise TinkerUserError(
                f"{PARAMS}.stop", f"token id {token} is outside the vocabulary [0, {vocab_size})"
            )
    room = max_length - len(call.prompt)
    if room < 1:
        raise TinkerUserError(
            "prompt",
            f"has {len(call.prompt)} tokens, leaving no room in the model's context "
            f"of {max_length}",
        )
    max_tokens = room if call.max_tokens is None else call.max_tokens
    if max_tokens > room:
        raise TinkerUserError(
            f"{PARAMS}.max_tokens",
            f"{max_tokens} plus the prompt's {len(call.prompt)} tokens "
            f"exceeds the model's context of {max_length}",
        )
    return dataclasses.replace(call, max_tokens=max_tokens)


@dataclass(frozen=True)
class SampledSequence:
    """One finished sample: its tokens and the log-probs of the distribution sampled from."""

    tokens: Sequence[int] | np.ndarray
    logprobs: Sequence[float] | np.ndarray
    stop_reason: Literal["stop", "length"]


TopkRow = Sequence[tuple[int, float]] | None


def encode_sample_response(
    sequences: Sequence[SampledSequence],
    prompt_logprobs: Sequence[float | None] | None = None,
    topk_prompt_logprobs: Sequence[TopkRow] | None = None,
    *,
    prompt_logprobs_last_n: int | None = None,
) -> bytes:
    """A protobuf `SampleResponse`, sequences in the order of the promise's ids.

    `prompt_logprobs` holds one entry per prompt token, None where there is none (the first
    token); `topk_prompt_logprobs` one row of (token id, log-prob) per prompt token, None
    likewise. With `prompt_logprobs_last_n`, entries before the last n are sent as missing.
    """
    pb = tinker_protobuf()
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    out = pb.SampleResponse()
    for seq in sequences:
        tokens = np.asarray(seq.tokens, dtype="<i4")
        logprobs = np.asarray(seq.logprobs, dtype="<f4")
        assert tokens.shape == logprobs.shape, "one log-prob per sampled token"
        out.sequences.add(
            stop_reason=reasons[seq.stop_reason],
            tokens=tokens.tobytes(),
            logprobs=logprobs.tobytes(),
        )
    skip = 0
    if prompt_logprobs is not None:
        values = np.array([np.nan if v is None else v for v in prompt_logprobs], dtype="<f4")
        skip = len(values) - prompt_logprobs_last_n if prompt_logprobs_last_n else 0
        values[:skip] = np.nan
        out.prompt_logprobs = values.tobytes()
    if topk_prompt_logprobs is not None:
        if prompt_logprobs_last_n:
            skip = len(topk_prompt_logprobs) - prompt_logprobs_last_n
        out.topk_prompt_logprobs.CopyFrom(_topk_matrix(pb, topk_prompt_logprobs, skip))
    return out.SerializeToString()


def _topk_matrix(pb: Any, rows: Sequence[TopkRow], skip: int) -> Any:
    """Dense (positions, k) matrices, empty cells (0, TOPK_EMPTY_LOGPROB), as the SDK reads."""
    k = max((len(row) for row in rows if row), default=0)
    token_ids = np.zeros((len(rows), k), dtype="<i4")
    logprobs = np.full((len(rows), k), TOPK_EMPTY_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        if row and i >= skip:
            token_ids[i, : len(row)] = [token for token, _ in row]
            logprobs[i, : len(row)] = [logprob for _, logprob in row]
    return pb.TopkLogprobs(
        token_ids=token_ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(rows)
    )
