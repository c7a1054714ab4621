"""OpenAI response shapes (plus vLLM's RL extensions) for chat and text completions.

Kept apart from the routes so the JSON an RL client depends on is in one place:
`logprobs` in the chat shape (`content[].{token, logprob, bytes, top_logprobs}`)
and the completions shape (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`); `token_ids`/`prompt_token_ids` when `return_token_ids` is set
(chat: prompt ids at the top level; completions: per choice, as vLLM does);
`stop_reason` as in vLLM; vLLM's per-choice `prompt_logprobs` on completions; and our
`weight_versions`, one per generated token.

Tool calls parsed out of the generated text become the message's `tool_calls`
(finish reason `tool_calls`, as vLLM reports it); a stream of such a response is
the finished response cut into chunks (`chunks_of`), since a half-generated
call cannot be shown.

Log-probs leave as valid JSON: a token that top-k or top-p masked out has log-prob
`-inf` in the engine, which JSON cannot carry, so it is reported as -9999.0, the
floor vLLM's OpenAI layer uses; NaN (never produced by the engine) would get the same.
"""

from __future__ import annotations

import time

from asyncgrpo.inference.engine.types import PromptLogprobs
from asyncgrpo.inference.server.generation import Choice
from asyncgrpo.inference.server.toolcalls import ParseResult


class TokenText:
    """Token id -> its text (cached: top-log-prob lists repeat the same ids)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


LOGPROB_FLOOR = -9999.0  # what vLLM reports for -inf


def json_logprob(logprob: float) -> float:
    """`logprob` within [-9999.0, 0]: -inf and NaN, which JSON cannot carry, become the floor."""
    if not logprob > LOGPROB_FLOOR:  # NaN compares False
        return LOGPROB_FLOOR
    return min(logprob, 0.0)


def chat_logprobs(token_text: TokenText, ids, logprobs, tops) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {
            "token": text,
            "logprob": json_logprob(logprob),
            "bytes": list(text.encode("utf-8")),
        }

    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top]}
            for t, lp, top in zip(ids, logprobs, tops)
        ]
    }


def completion_logprobs(token_text: TokenText, ids, logprobs, tops, offset: int = 0) -> dict:
    tokens = [token_text(t) for t in ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    top_dicts = []
    for t, lp, top in zip(ids, logprobs, tops):
        alternatives = {token_text(a): json_logprob(alp) for a, alp in top}
        # the sampled token is always listed, as in vLLM
        alternatives[token_text(t)] = json_logprob(lp)
        top_dicts.append(alternatives)
    return {
        "tokens": tokens,
        "token_logprobs": [json_logprob(lp) for lp in logprobs],
        "top_logprobs": top_dicts,
        "text_offset": offsets,
    }


def prompt_logprobs_json(
    token_text: TokenText, prompt: list[int], scores: PromptLogprobs | None
) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per position a dict
    token id (a string, as JSON keys are) -> {logprob, rank, decoded_token}: the prompt
    token with its rank in the vocabulary, then the top-k with ranks 1..k (the prompt
    token once if it is among them)."""
    if scores is None:
        return None

    def entry(token_id: int, logprob: float, rank: int) -> dict:
        return {
            "logprob": json_logprob(logprob),
            "rank": rank,
            "decoded_token": token_text(token_id),
        }

    out: list[dict | None] = [None]
    for i, (logprob, rank, top) in enumerate(zip(scores.logprobs, scores.ranks, scores.top)):
        token = prompt[i + 1]
        position = {str(token): entry(token, logprob, rank)}
        for top_rank, (top_id, top_logprob) in enumerate(top, start=1):
            position[str(top_id)] = entry(top_id, top_logprob, top_rank)
        out.append(position)
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(
    job_id: str, kind: str, model: str, choices: list[dict], created: int | None = None
) -> dict:
    return {
        "id": job_id,
        "object": kind,
        "created": created or int(time.time()),
        "model": model,
        "choices": choices,
    }


def chat_choice(
    c: Choice,
    token_text: TokenText,
    with_logprobs: bool,
    with_ids: bool,
    parsed: ParseResult | None = None,
) -> dict:
    """`parsed`: the text split into content and tool calls (None: no tools requested)."""
    message = {"role": "assistant", "content": c.text.text}
    finish_reason = c.finish_reason
    if parsed is not None and parsed.tool_calls:
        message["content"] = parsed.content
        message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
        finish_reason = "tool_calls"
    choice = {
        "index": c.index,
        "message": message,
        "logprobs": chat_logprobs(token_text, c.token_ids, c.logprobs, c.top_logprobs)
        if with_logprobs
        else None,
        "finish_reason": finish_reason,
        "stop_reason": c.stop_reason,
        "weight_versions": c.versions,
    }
    if with_ids:
        choice["token_ids"] = c.token_ids
    return choice


def chunks_of(response: dict, include_usage: bool) -> list[dict]:
    """A finished `chat.completion` as the chunks of a stream: one per choice, then usage."""
    kind = "chat.completion.chunk"
    out = []
    for position, choice in enumerate(response["choices"]):
        message = choice["message"]
        delta = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            delta["tool_calls"] = [
                {"index": i, **call} for i, call in enumerate(message["tool_calls"])
            ]
        entry = {k: v for k, v in choice.items() if k != "message"}
        chunk = envelope(response["id"], kind, response["model"], [{**entry, "delta": delta}])
        if position == 0 and "prompt_token_ids" in response:
            chunk["prompt_token_ids"] = response["prompt_token_ids"]
        out.append(chunk)
    if include_usage:
        final = envelope(response["id"], kind, response["model"], [])
        final["usage"] = response["usage"]
        out.append(final)
    return out


def completion_choice(
    c: Choice, token_text: TokenText, with_logprobs: bool, with_ids: bool, prompt: list[int]
) -> dict:
    choice = {
        "index": c.index,
        "text": c.text.text,
        "logprobs": completion_logprobs(token_text, c.token_ids, c.logprobs, c.top_logprobs)
        if with_logprobs
        else None,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
        "weight_versions": c.versions,
        "prompt_logprobs": prompt_logprobs_json(token_text, prompt, c.prompt_logprobs),
    }
    if with_ids:
        choice["token_ids"] = c.token_ids
        choice["prompt_token_ids"] = prompt
    return choice
