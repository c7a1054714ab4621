"""The Tinker wire format of `forward_backward`, read and written with the SDK's own classes.

`tinker` 0.38 sends `forward_backward` (and `forward`, the same request with
`forward_only`) as a protobuf `ForwardBackwardRequest` and accepts its result only as a
protobuf `ForwardBackwardOutput`. The message classes are the SDK's
(`tinker.proto.tinker_public_pb2`), imported when first needed, so the core installs
without them and no copy of them can drift. Every refusal is a `TinkerUserError` naming the
field by the path the SDK's request types give it; sizes are checked against
`TinkerLimits` before anything is copied. Sampling's wire is in `sample_wire.py`.

What the SDK validates in each answer (types in `tinker.types`; "future" means the route
answers `UntypedAPIFuture` `{request_id, model_id?}` and `retrieve_future` later answers
the result, as JSON unless marked protobuf, or `{"type": "try_again", "request_id"}`
while pending, or `{"error", "category"}` when failed):

| route | request body | answer |
|---|---|---|
| client/config | `{sdk_version}` | `ClientConfigResponse` (all fields defaulted) |
| client/dynamic_config | `{sdk_version}` | `ClientDynamicConfigResponse` (refetched every `refresh_interval_sec`) |
| create_session | `{tags, user_metadata, sdk_version, ...}` | `CreateSessionResponse{session_id}` |
| session_heartbeat | `{session_id}` (every 10 s) | `SessionHeartbeatResponse{type}`; HTTP 410 stops the heartbeats |
| sessions/{id}/finish | `{reason: {type}, detail}` (`ServiceClient.close`) | anything (not read) |
| create_model | `CreateModelRequest` (`decode_create_model`) | future → `CreateModelResponse{model_id}` |
| get_info | `{model_id}` | `GetInfoResponse{model_id, model_data{model_name, tokenizer_id}, is_lora, lora_rank}` |
| forward_backward | protobuf (`decode_forward_backward`) | future → protobuf (`encode_forward_backward_output`) |
| optim_step | `{model_id, seq_id, adam_params}` (`decode_optim_step`) | future → `OptimStepResponse{metrics?}` |
| save_weights | `{model_id, seq_id, path?, ...}` | future → `SaveWeightsResponse{path}` |
| save_weights_for_sampler | `{model_id, seq_id, path? \\| sampling_session_seq_id?, kind}` | future → `SaveWeightsForSamplerResponseInternal{path? , sampling_session_id?}` |
| load_weights | `{model_id, seq_id}` or `{session_id, model_seq_id}` (seq 0), `path, optimizer` | future → `LoadWeightsResponse{path?, model_id?}` |
| create_sampling_session | `{session_id, sampling_session_seq_id, base_model?, model_path?}` | `CreateSamplingSessionResponse{sampling_session_id}` |
| samplers/{id} (GET) | — | `GetSamplerResponse{sampler_id, base_model, model_path?}` |
| asample | JSON `SampleRequest` (`sample_wire.decode_sample_request`) | future with `sample_sequence_ids` → protobuf (`sample_wire.encode_sample_response`) |
| healthz (GET) | — | `HealthResponse{status: "ok"}` |

The listings of saved runs, checkpoints and sessions (`training_runs`, `weights_info`, ...)
are tabulated in `listings.py`.

Answers are validated leniently (extra keys ignored) but typed: a `type` key, where sent,
must be the route's literal. A protobuf result goes out with `Content-Type:
application/x-protobuf` (the SDK asks with `Accept`; a JSON answer to it is an error). A
pending result may also be HTTP 408. A submission refused with HTTP 400 raises in the client
at once (only `retrieve_future` retries a bare 400) but leaves its `seq_id` spent, so a
refusal that knows the operation (`TinkerUserError.request_key`) is better sent as that
future's failure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncgrpo.tinker.errors import TinkerUserError
from asyncgrpo.tinker.limits import TinkerLimits

DATA = "forward_backward_input.data"
LOSS_FN = "forward_backward_input.loss_fn"
LOSS_FN_CONFIG = "forward_backward_input.loss_fn_config"

_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": _RL_INPUTS,
    "ppo": _RL_INPUTS,
    "cispo": _RL_INPUTS,
    "dro": _RL_INPUTS,
    "gspo": (*_RL_INPUTS, "sequence_ratio_mask"),
}
"""The `loss_fn_inputs` each loss takes, all of them required (as the Tinker docs list them)."""

_CLIP = ("clip_low_threshold", "clip_high_threshold")
LOSS_CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": (),
    "ppo": _CLIP,
    "cispo": _CLIP,
    "dro": ("beta",),
    "gspo": _CLIP,
}
"""The `loss_fn_config` keys each loss reads (all optional, all numbers)."""

INTEGER_INPUTS = frozenset({"target_tokens"})
"""Inputs that hold token ids: int64 on the wire. Every other input is float32 (an int64
one is widened, as the SDK itself turns an integer numpy array into int64)."""

METRIC_REDUCTIONS = frozenset({"mean", "sum", "min", "max", "slack", "hash2", "unique"})
"""The reductions the SDK's chunk merge knows (`chunked_fwdbwd_helpers.REDUCE_MAP`)."""

_PROTO_HINT = "pip install 'asyncgrpo[tinker]'"


def tinker_protobuf() -> Any:
    """The SDK's generated protobuf module, imported on first use."""
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as exc:
        raise ImportError(
            f"The Tinker API speaks the tinker SDK's protobuf messages: {_PROTO_HINT}"
        ) from exc
    return tinker_public_pb2


@dataclass(frozen=True)
class TinkerDatum:
    """One training example: position i of `tokens` predicts `inputs["target_tokens"][i]`."""

    tokens: np.ndarray  # (N,) int64, the model input's text chunks concatenated
    inputs: dict[str, np.ndarray]  # name -> (N,) float32, or int64 for token ids

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class ForwardBackwardCall:
    """A decoded `forward_backward` (or `forward`, when `forward_only`) request."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    datums: list[TinkerDatum] = field(repr=False)


def check_body_size(body: bytes, limits: TinkerLimits) -> None:
    """Refuse a body over `limits.max_request_bytes` before it is parsed."""
    if len(body) > limits.max_request_bytes:
        raise TinkerUserError(
            "",
            f"the request body has {len(body)} bytes, over this server's limit of "
            f"{limits.max_request_bytes}",
        )


def decode_forward_backward(body: bytes, limits: TinkerLimits) -> ForwardBackwardCall:
    """Decode a protobuf `ForwardBackwardRequest`, refusing what no loss could use."""
    check_body_size(body, limits)
    msg = tinker_protobuf().ForwardBackwardRequest()
    from google.protobuf.message import DecodeError

    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise TinkerUserError(
            "", f"the body is not a ForwardBackwardRequest protobuf ({exc})"
        ) from None
    if not msg.model_id:
        raise TinkerUserError("model_id", "is empty")
    if msg.seq_id < 0:
        raise TinkerUserError("seq_id", f"must not be negative, got {msg.seq_id}")
    try:
        if not msg.loss_fn:
            raise TinkerUserError(LOSS_FN, "is empty")
        _check_counts(msg.data, limits)
        datums = [_decode_datum(datum, f"{DATA}[{i}]") for i, datum in enumerate(msg.data)]
        config = _loss_fn_config(msg)
    except TinkerUserError as exc:
        exc.request_key = (msg.model_id, msg.seq_id)
        raise
    return ForwardBackwardCall(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        loss_fn=msg.loss_fn,
        loss_fn_config=config,
        forward_only=msg.forward_only,
        datums=datums,
    )


def _check_counts(data: Any, limits: TinkerLimits) -> None:
    """Datum count and declared token lengths, from byte sizes alone (nothing copied)."""
    if len(data) == 0:
        raise TinkerUserError(DATA, "holds no datums")
    if len(data) > limits.max_datums_per_request:
        raise TinkerUserError(
            DATA,
            f"holds {len(data)} datums, over this server's limit of "
            f"{limits.max_datums_per_request} per request",
        )
    total = 0
    for i, datum in enumerate(data):
        n = 0
        for j, chunk in enumerate(datum.model_input):
            n += _text_chunk_length(chunk, f"{DATA}[{i}].model_input.chunks[{j}]")
        if n > limits.max_tokens_per_datum:
            raise TinkerUserError(
                f"{DATA}[{i}].model_input",
                f"has {n} tokens, over this server's limit of {limits.max_tokens_per_datum}",
            )
        total += n
    if total > limits.max_total_tokens_per_request:
        raise TinkerUserError(
            DATA,
            f"holds {total} tokens in all, over this server's limit of "
            f"{limits.max_total_tokens_per_request} per request",
        )


def _text_chunk_length(chunk: Any, where: str) -> int:
    kind = chunk.WhichOneof("chunk")
    if kind != "encoded_text":
        raise TinkerUserError(
            where,
            f"is a {kind or 'empty'} chunk: not supported, this server takes token ids "
            "(EncodedTextChunk) only",
        )
    size = len(chunk.encoded_text.tokens)
    if size % 4:
        raise TinkerUserError(where, f"holds {size} bytes of tokens, not a whole number of int32")
    return size // 4


def _decode_datum(datum: Any, where: str) -> TinkerDatum:
    pieces = [np.frombuffer(chunk.encoded_text.tokens, dtype="<i4") for chunk in datum.model_input]
    tokens = np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, np.int64)
    if len(tokens) == 0:
        raise TinkerUserError(f"{where}.model_input", "holds no tokens")
    inputs = {
        name: _decode_tensor(tensor, f"{where}.loss_fn_inputs.{name}", name, len(tokens))
        for name, tensor in datum.loss_fn_inputs.items()
    }
    return TinkerDatum(tokens=tokens, inputs=inputs)


def _decode_tensor(tensor: Any, where: str, name: str, length: int) -> np.ndarray:
    """A protobuf `Tensor` as a (length,) array: int64 for token ids, float32 otherwise.

    Dense or sparse CSR; shape `[]` (rLLM sends none) or `[length]` or `[length, 1]`.
    """
    pb = tinker_protobuf()
    dtypes = {pb.DTYPE_FLOAT32: np.dtype("<f4"), pb.DTYPE_INT64: np.dtype("<i8")}
    if tensor.dtype not in dtypes:
        raise TinkerUserError(
            where,
            f"has dtype {pb.DType.Name(tensor.dtype)}: send float32 or int64",
        )
    dtype = dtypes[tensor.dtype]
    if name in INTEGER_INPUTS and dtype.kind != "i":
        raise TinkerUserError(where, "holds token ids, so its dtype must be int64, not float32")
    shape = list(tensor.shape)
    if shape not in ([], [length], [length, 1]):
        raise TinkerUserError(
            where,
            f"has shape {shape}: this server takes one value per model-input position, "
            f"shape [{length}] (the model input has {length} tokens)",
        )
    if tensor.WhichOneof("encoding") == "sparse_csr":
        values = _decode_csr(tensor.sparse_csr, dtype, shape, where)
    else:
        values = _decode_dense(tensor.dense, dtype, length, where)
    if name not in INTEGER_INPUTS:
        values = values.astype(np.float32)
        if not np.isfinite(values).all():
            bad = int(np.flatnonzero(~np.isfinite(values))[0])
            raise TinkerUserError(where, f"holds {values[bad]} at position {bad}: must be finite")
    return values


def _decode_dense(data: bytes, dtype: np.dtype, length: int, where: str) -> np.ndarray:
    if len(data) % dtype.itemsize:
        raise TinkerUserError(where, f"holds {len(data)} bytes, not a whole number of {dtype.name}")
    count = len(data) // dtype.itemsize
    if count != length:
        raise TinkerUserError(
            where,
            f"holds {count} values but the model input has {length} tokens: every "
            "loss_fn_input needs one value per model-input position",
        )
    return np.frombuffer(data, dtype=dtype).astype(dtype.newbyteorder("="))


def _decode_csr(csr: Any, dtype: np.dtype, shape: list[int], where: str) -> np.ndarray:
    """Densify a CSR tensor of shape [rows, 1], checking every index before writing."""
    if len(shape) != 2:
        raise TinkerUserError(where, f"is sparse CSR with shape {shape}: CSR needs [rows, cols]")
    rows, cols = shape
    for part, blob, size in (
        ("crow_indices", csr.crow_indices, 8),
        ("col_indices", csr.col_indices, 8),
        ("values", csr.values, dtype.itemsize),
    ):
        if len(blob) % size:
            raise TinkerUserError(f"{where}.{part}", f"holds {len(blob)} bytes, not whole values")
    nnz = len(csr.col_indices) // 8
    if len(csr.crow_indices) // 8 != rows + 1:
        raise TinkerUserError(f"{where}.crow_indices", f"must hold rows + 1 = {rows + 1} values")
    if len(csr.values) // dtype.itemsize != nnz or nnz > rows * cols:
        raise TinkerUserError(f"{where}.values", f"must hold one value per column index ({nnz})")
    crow = np.frombuffer(csr.crow_indices, dtype="<i8")
    col = np.frombuffer(csr.col_indices, dtype="<i8")
    if crow[0] != 0 or crow[-1] != nnz or (np.diff(crow) < 0).any():
        raise TinkerUserError(
            f"{where}.crow_indices", f"must rise from 0 to the number of values ({nnz})"
        )
    if nnz and (col.min() < 0 or col.max() >= cols):
        raise TinkerUserError(f"{where}.col_indices", f"must lie in [0, {cols})")
    cell = np.repeat(np.arange(rows), np.diff(crow)) * cols + col  # (nnz,) flat positions
    if (np.diff(cell) <= 0).any():
        raise TinkerUserError(f"{where}.col_indices", "must rise within each row (no repeats)")
    dense = np.zeros(rows * cols, dtype=dtype.newbyteorder("="))
    dense[cell] = np.frombuffer(csr.values, dtype=dtype)
    return dense


def _loss_fn_config(msg: Any) -> dict[str, float | str]:
    """`loss_fn_config_v2` (numbers or text), falling back on the legacy float-only map."""
    config: dict[str, float | str] = {}
    for key, value in msg.loss_fn_config_v2.items():
        kind = value.WhichOneof("value")
        if kind is None:
            raise TinkerUserError(f"{LOSS_FN_CONFIG}.{key}", "holds neither a number nor text")
        config[key] = value.number if kind == "number" else value.text
    for key, number in msg.loss_fn_config.items():
        config.setdefault(key, number)
    return config


def required_inputs(loss_fn: str) -> tuple[str, ...]:
    """The inputs `loss_fn` takes; a user error naming the alternatives for any other name."""
    if loss_fn in REQUIRED_INPUTS:
        return REQUIRED_INPUTS[loss_fn]
    if loss_fn == "stable_reinforce":
        problem = (
            "'stable_reinforce' is not served: its objective is not public. Use "
            "'importance_sampling' (the cookbook's choice) or 'ppo' instead"
        )
    elif loss_fn == "custom":
        problem = (
            "server-side custom losses are not served; forward_backward_custom computes the "
            "loss on the client (through cross_entropy) when client/config leaves "
            "custom_loss_server_side off"
        )
    else:
        problem = f"{loss_fn!r} is not a loss this server knows; it serves " + ", ".join(
            sorted(REQUIRED_INPUTS)
        )
    raise TinkerUserError(LOSS_FN, problem)


def check_datums(datums: list[TinkerDatum], loss_fn: str, vocab_size: int, max_length: int) -> None:
    """Refuse datums that `loss_fn` cannot train on, naming the first field at fault.

    Each datum must carry exactly the inputs of `REQUIRED_INPUTS[loss_fn]`, token ids (model
    input and `target_tokens`) in [0, vocab_size), and at most `max_length` tokens.
    """
    required = required_inputs(loss_fn)
    for i, datum in enumerate(datums):
        where = f"{DATA}[{i}]"
        if datum.length > max_length:
            raise TinkerUserError(
                f"{where}.model_input",
                f"has {datum.length} tokens, over the model's context of {max_length}",
            )
        _check_token_ids(datum.tokens, f"{where}.model_input", vocab_size)
        for name in required:
            if name not in datum.inputs:
                raise TinkerUserError(
                    f"{where}.loss_fn_inputs.{name}",
                    f"is missing: loss_fn {loss_fn!r} takes " + ", ".join(required),
                )
        for name in sorted(set(datum.inputs) - set(required)):
            raise TinkerUserError(
                f"{where}.loss_fn_inputs.{name}",
                f"is not an input of loss_fn {loss_fn!r}, which takes " + ", ".join(required),
            )
        _check_token_ids(
            datum.inputs["target_tokens"], f"{where}.loss_fn_inputs.target_tokens", vocab_size
        )


def _check_token_ids(ids: np.ndarray, where: str, vocab_size: int) -> None:
    outside = (ids < 0) | (ids >= vocab_size)
    if outside.any():
        at = int(np.flatnonzero(outside)[0])
        raise TinkerUserError(
            where,
            f"holds token id {int(ids[at])} at position {at}, outside the vocabulary "
            f"[0, {vocab_size})",
        )


def check_loss_config(loss_fn: str, config: dict[str, float | str]) -> None:
    """Refuse config keys `loss_fn` does not read, and values that are not finite numbers."""
    required_inputs(loss_fn)  # refuses an unknown loss first
    allowed = LOSS_CONFIG_KEYS[loss_fn]
    for key, value in config.items():
        where = f"{LOSS_FN_CONFIG}.{key}"
        if key not in allowed:
            reads = ", ".join(allowed) if allowed else "no config"
            raise TinkerUserError(where, f"is not read by loss_fn {loss_fn!r}, which reads {reads}")
        if isinstance(value, str) or not math.isfinite(value):
            raise TinkerUserError(where, f"must be a finite number, got {value!r}")
    low = config.get("clip_low_threshold", 0.8)
    high = config.get("clip_high_threshold", 1.2)
    if not 0 <= float(low) <= 1 <= float(high):
        raise TinkerUserError(
            LOSS_FN_CONFIG,
            f"clip thresholds bound the ratio: need 0 <= clip_low_threshold "
            f"({low}) <= 1 <= clip_high_threshold ({high})",
        )
    if float(config.get("beta", 0.0)) < 0:
        raise TinkerUserError(f"{LOSS_FN_CONFIG}.beta", "must not be negative")


def encode_forward_backward_output(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """A protobuf `ForwardBackwardOutput`: per datum its `logprobs` (float32, length N).

    `metrics` keys must read `name:reduction` (the SDK splits on the colon to merge chunks);
    the SDK's `forward_backward_custom` pops `loss:sum`, so a server always sends it.
    """
    for key in metrics:
        name, colon, reduction = key.partition(":")
        assert name and colon and ":" not in reduction and reduction in METRIC_REDUCTIONS, (
            f"metric {key!r} must read name:reduction, reduction in {sorted(METRIC_REDUCTIONS)}"
        )
    pb = tinker_protobuf()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    out.metrics.update({key: float(value) for key, value in metrics.items()})
    if logprobs:
        arrays = [np.ascontiguousarray(lp, dtype="<f4").reshape(-1) for lp in logprobs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype="<i8")
        record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(arrays))
        field_ = record.fields["logprobs"]
        field_.data = b"".join(a.tobytes() for a in arrays)
        field_.offsets = offsets.tobytes()
        field_.dtype = pb.DTYPE_FLOAT32
    return out.SerializeToString()
