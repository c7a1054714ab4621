"""How much one Tinker request may ask for, checked before anything big is allocated.

A server on a laptop shares its memory with the model: one request with a million datums
or a prompt of a billion tokens must be refused with a user error naming the field, not
answered with an out-of-memory kill of every user's run. The wire decoders check the body's
byte size before parsing it, and the declared counts (datums, tokens, tensor shapes,
samples) before copying or densifying anything, against these bounds.

The defaults leave room over what the SDK sends by itself: it splits a `forward_backward`
into chunks of at most 1024 datums and about 5 MB (`ClientConfigResponse.fwdbwd_max_chunk_len`
and `fwdbwd_max_chunk_bytes_count`, which the server's `client/config` may lower).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TinkerLimits:
    """Per-request bounds of the Tinker service."""

    max_request_bytes: int = 32 * 1024 * 1024
    """Largest request body, protobuf or JSON, in bytes (the SDK's chunks are about 5 MB)."""

    max_datums_per_request: int = 1024
    """Most datums in one `forward_backward` request (the SDK's own chunk length)."""

    max_tokens_per_datum: int = 32768
    """Longest model input of a datum, and longest sampling prompt, in tokens."""

    max_total_tokens_per_request: int = 262144
    """Most model-input tokens summed over the datums of one `forward_backward` request."""

    max_num_samples: int = 128
    """Most sequences one `sample` request may ask for (`num_samples`)."""

    max_sample_tokens: int = 32768
    """Largest `sampling_params.max_tokens`; also what an absent `max_tokens` is capped at."""

    max_stop_sequences: int = 64
    """Most entries of `sampling_params.stop`."""

    max_topk_logprobs: int = 20
    """Largest `topk_prompt_logprobs`."""

    max_lora_rank: int = 256
    """Largest `lora_config.rank` of `create_model`."""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TinkerLimits.{name} must be a positive integer, got {value!r}")
