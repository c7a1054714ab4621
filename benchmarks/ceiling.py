"""What the hardware multiplies, and the FLOPs a generation needs at least: the two
halves of an MFU figure, shared by `trainer_speed.py` and `engine_throughput.py`.

A benchmark's tokens/s says little across machines; the same run's matmul rate at the
model's own shapes says how close to the hardware it ran. `generation_flops` counts the
minimal work of a generation workload: each prompt prefilled once (however many samples
it has), 2 FLOPs per linear weight per input token, the LM head once per generated token,
and 4·d_q FLOPs per attended (query, key) pair per layer.
"""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_tflops(
    m: int, k: int, n: int, dtype, device: torch.device, repeats: int = 10, round_s: float = 0.05
) -> float:
    """The best rate of an (m, k) @ (k, n) product on this device, after warm-ups: `repeats`
    rounds of back-to-back products lasting about `round_s` each, the fastest round.

    The fastest, not the median of single products: another process on the cores only
    slows a round, so the best one is the nearest to what the hardware multiplies (a median
    of ten 32x576x1536 products once read 0.007 TFLOP/s beside a server shutting down, 0.35
    to 0.49 in the runs before)."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    calls = max(1, round(round_s / _seconds(a, b, 1, device)))
    best = min(_seconds(a, b, calls, device) for _ in range(repeats))
    return 2 * m * k * n / best / 1e12


def _seconds(a: torch.Tensor, b: torch.Tensor, calls: int, device: torch.device) -> float:
    """Seconds per product over `calls` back-to-back products."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        a @ b
    synchronize(device)
    return max(time.perf_counter() - start, 1e-9) / calls


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def linear_weights(config) -> tuple[int, int]:
    """(weights of the decoder's linear layers, weights of the LM head) of a Llama-style
    transformers config."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_attention_heads * head_dim(config)
    kv_dim = config.num_key_value_heads * head_dim(config)
    per_layer = hidden * (2 * q_dim + 2 * kv_dim) + 3 * hidden * inter
    return config.num_hidden_layers * per_layer, config.vocab_size * hidden


def generation_flops(config, prompt_lengths: list[int], samples: int, mean_length: float) -> float:
    """Minimal FLOPs to generate `samples` completions of `mean_length` tokens for each
    prompt (the attention term at the mean length: exact for fixed lengths). A prompt's
    prefill, once, yields the first token; each later token takes one decode input, and
    the last generated token is never an input."""
    body, head = linear_weights(config)
    attend = 4 * config.num_hidden_layers * config.num_attention_heads * head_dim(config)
    n = mean_length
    total = 0.0
    for p in prompt_lengths:
        total += 2 * body * p + attend * p * (p + 1) / 2
        per_sample = 2 * body * (n - 1) + 2 * head * n + attend * ((n - 1) * p + (n - 1) * n / 2)
        total += samples * per_sample
    return total
