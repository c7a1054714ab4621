"""From a request to prompt token ids: size-checked first, rendered and tokenized off the loop.

Rendering a chat template and tokenizing are CPU work proportional to the input,
and a request body may hold 16 MB of text: on the event loop that would stall
every other request (and `/health`) for seconds. So both run on a small pool of
worker threads, and before any text is tokenized its length is compared with a
cheap lower bound on its token count: no token is longer than the longest
string in the vocabulary, so a text of `c` characters has at least
`c / longest` tokens. A text that cannot fit in `max_model_len` by that bound is
refused without being tokenized. (A normalizer that deletes characters, as
BERT's accent stripping does, could make the bound refuse a text that would
fit; causal LMs' byte-level and SentencePiece tokenizers do not.)
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncgrpo.inference.engine.types import RequestError
from asyncgrpo.inference.server.protocol import (
    ChatCompletionRequest,
    RequestLimits,
    refuse_lone_surrogates,
)
from asyncgrpo.inference.server.trajectory import ChatRenderer, TrajectoryBuilder, next_prompt_ids

_WORKERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="asyncgrpo-prompts")
_LONGEST_TOKEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def off_loop(fn, *args):
    """`fn(*args)` on a prompt worker thread; the event loop keeps serving meanwhile."""
    return await asyncio.get_running_loop().run_in_executor(_WORKERS, functools.partial(fn, *args))


def longest_token_chars(tokenizer) -> int:
    """Characters in the longest vocabulary entry: no token covers more of a text."""
    if tokenizer not in _LONGEST_TOKEN:
        _LONGEST_TOKEN[tokenizer] = max(map(len, tokenizer.get_vocab()), default=1)
    return _LONGEST_TOKEN[tokenizer]


def check_text_fits(tokenizer, text_chars: int, param: str, max_model_len: int) -> None:
    """Refuse, without tokenizing, a text too long for the context whatever its tokens."""
    at_least = math.ceil(text_chars / longest_token_chars(tokenizer))
    if at_least + 1 > max_model_len:
        raise RequestError(
            f"{param} has {text_chars} characters, so at least {at_least} tokens, but "
            f"max_model_len is {max_model_len} (prompt + at least one generated token must fit)",
            400,
            param,
        )


def encode(tokenizer, text: str, param: str, limits: RequestLimits, special: bool) -> list[int]:
    """Token ids of `text`, after the cheap size check and the Unicode check."""
    check_text_fits(tokenizer, len(text), param, limits.max_model_len)
    refuse_lone_surrogates(param, [text])
    return tokenizer(text, add_special_tokens=special)["input_ids"]


def tokenize_prompts(
    tokenizer, prompts: list[str | list[int]], special: bool, limits: RequestLimits
) -> list[list[int]]:
    """The prompts of a completion request as token ids (token-id prompts pass through)."""
    return [
        encode(tokenizer, p, "prompt", limits, special) if isinstance(p, str) else list(p)
        for p in prompts
    ]


def render_chat(tokenizer, request: ChatCompletionRequest) -> str:
    """The messages (and tools) rendered with the model's chat template.

    With `tools` and a generation prompt, `ChatRenderer` renders them (the
    system-message fallback for templates that ignore tools).
    """
    messages = [m.for_template() for m in request.messages]
    kwargs = request.chat_template_kwargs or {}
    try:
        if request.tools and request.add_generation_prompt and not request.continue_final_message:
            return ChatRenderer(tokenizer, request.tools, kwargs).render(messages, True)
        return tokenizer.apply_chat_template(
            messages,
            tools=request.tools,
            tokenize=False,
            add_generation_prompt=request.add_generation_prompt
            and not request.continue_final_message,
            continue_final_message=request.continue_final_message,
            **kwargs,
        )
    except RequestError:
        raise
    except Exception as exc:  # jinja errors, templates that raise on bad roles, ...
        raise RequestError(f"cannot render the chat template: {exc}") from None


def chat_prompt_ids(tokenizer, request: ChatCompletionRequest, limits: RequestLimits) -> list[int]:
    """The prompt of a chat request: rendered, size-checked, tokenized (call it off the loop)."""
    return encode(tokenizer, render_chat(tokenizer, request), "messages", limits, special=False)


def content_chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(m.get("content") or "") for m in messages)


def episode_prompt_ids(
    builder: TrajectoryBuilder,
    messages: list[dict[str, Any]],
    tokenizer,
    request: ChatCompletionRequest,
    limits: RequestLimits,
) -> list[int]:
    """The next prompt of an agent episode (call it off the loop).

    The episode's renderer tokenizes inside, so the size check counts the
    messages' content, which every chat template writes out.
    """
    templated = [m.for_template() for m in request.messages]
    check_text_fits(tokenizer, content_chars(templated), "messages", limits.max_model_len)
    # the renderer tokenizes inside: refuse what no tokenizer takes before it is called
    refuse_lone_surrogates("messages", [json.dumps(templated, ensure_ascii=False)])
    try:
        return next_prompt_ids(
            builder, messages, tokenizer, request.tools, request.chat_template_kwargs
        )
    except Exception as exc:  # jinja errors, templates that raise on bad roles, ...
        raise RequestError(f"cannot render the chat template: {exc}") from None
