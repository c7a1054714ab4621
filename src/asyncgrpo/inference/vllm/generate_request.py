"""The body of a request to vLLM's token-in/token-out route, built in one place.

Two callers generate on vLLM: the trainer's `VLLMClient.complete` (single-turn
rollouts) and the episode gateway's `RemoteEngine.generate` (agents, through
asyncgrpo's OpenAI routes). Both send `POST /inference/v1/generate` with the body
built here, so a sampling setting, a seed or a prefix-cache salt means the same
thing whichever side sent it.

The rules:

- **Sampling.** `top_k` 0 is vLLM's "off" (our -1 and 0 both mean off). Stop
  strings are matched on text decoded with special tokens kept
  (`skip_special_tokens: false`), as the embedded engine matches them; vLLM's
  default would skip them, and a stop string such as "<|im_end|>" would never
  match. `logprobs` is 0 (the sampled token's only) unless alternatives are asked
  for: then one more than asked, because vLLM puts the sampled token first
  whatever its rank (the gateway re-ranks), capped at the server's `max_logprobs`.
  Empty stop lists are left out. `prompt_logprobs` (the prompt's log-probs under the
  raw model distribution, plus the k most likely tokens) is passed on when asked for:
  vLLM computes them from the raw logits whatever `--logprobs-mode` says.
- **Seed.** A seed is sent only to a server on an accelerator (`seeds_are_safe`):
  on a CPU a per-request seed kills vLLM's engine (0.32's CPU backend) as soon as
  that prompt is prefilled in chunks, and a server whose device is unknown counts
  as a CPU. What happens to a seed that may not be sent
  is the caller's contract, decided before the body is built: the trainer's seeds
  are derived from the recipe's seed, a wish the run can live without (dropped,
  with one warning); an API caller asked for its seed explicitly and must not be
  told it was honoured (the gateway refuses it, 400 naming `seed`).
- **Cache salt.** A request is salted with the label of the weights vLLM holds
  when it is sent, `asyncgrpo-{label}`: "default" for the weights vLLM started
  with, the version as a string after a sync (what `/weight_info` reports and
  `finish_weight_update` sets). vLLM's prefix cache only reuses blocks of requests
  with the same salt, so no prompt prefix computed under older weights serves a
  request on newer ones; the resets around a sync do not suffice, as vLLM refuses
  a reset while requests hold blocks (outside a pause, or under one with
  `clear_cache=false`). A request sent during a sync carries the old label, which
  is safe: vLLM queues it until the resume, and the pause asyncgrpo sends (vLLM's
  default `clear_cache=true`) empties the prefix cache, preempting requests in
  flight. Requests on the same weights share a salt whichever caller sent them.
  No salt is sent when the label is unknown: the trainer's client before its
  first sync (the server holds the weights it started with, and every later
  request of ours is salted), a gateway whose vLLM does not serve `/weight_info`
  (no dev mode: its weights cannot change).
"""

from __future__ import annotations

from typing import Any

from asyncgrpo.inference.engine.types import SamplingParams

GENERATE_PATH = "/inference/v1/generate"
VLLM_MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


def seeds_are_safe(device: str | None) -> bool:
    """Whether a per-request seed may reach a vLLM server on `device` (None: unknown)."""
    return device not in (None, "cpu")


def cache_salt(weight_label: str) -> str:
    """The prefix-cache salt of requests sampled with the weights labelled `weight_label`."""
    return f"asyncgrpo-{weight_label}"


def vllm_sampling_params(
    params: SamplingParams, *, send_seed: bool, max_logprobs: int = VLLM_MAX_LOGPROBS
) -> dict[str, Any]:
    """vLLM's `sampling_params` for ours; the seed only when `send_seed` (see the module)."""
    sampling: dict[str, Any] = {
        "n": params.n,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else 0,
        "ignore_eos": params.ignore_eos,
        "skip_special_tokens": False,
        "logprobs": min(params.top_logprobs + 1, max_logprobs) if params.top_logprobs else 0,
    }
    if params.stop:
        sampling["stop"] = list(params.stop)
    if params.stop_token_ids:
        sampling["stop_token_ids"] = list(params.stop_token_ids)
    if params.prompt_logprobs is not None:
        sampling["prompt_logprobs"] = params.prompt_logprobs
    if params.seed is not None and send_seed:
        sampling["seed"] = params.seed
    return sampling


def generate_request(
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    send_seed: bool,
    weight_label: str | None,
    max_logprobs: int = VLLM_MAX_LOGPROBS,
    model: str | None = None,
    request_id: str | None = None,
) -> dict[str, Any]:
    """The JSON body of `POST /inference/v1/generate` for `prompt_ids` sampled with `params`.

    `send_seed`: the server may receive a seed (`seeds_are_safe`); `weight_label`: vLLM's
    label of the weights it holds now, None if unknown (no salt); `model`: the served model
    or LoRA adapter to ask for; `request_id`: ours, which vLLM's abort route can name."""
    body: dict[str, Any] = {
        "token_ids": list(prompt_ids),
        "sampling_params": vllm_sampling_params(
            params, send_seed=send_seed, max_logprobs=max_logprobs
        ),
    }
    if weight_label is not None:
        body["cache_salt"] = cache_salt(weight_label)
    if model:
        body["model"] = model
    if request_id is not None:
        body["request_id"] = request_id
    return body
