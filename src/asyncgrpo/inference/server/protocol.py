"""Request bodies of the OpenAI routes, as pydantic models, and the checks they pass first.

Field names follow the OpenAI API plus vLLM's extensions that RL needs
(`top_k`, `stop_token_ids`, `ignore_eos`, `return_token_ids`,
`include_stop_str_in_output`, `skip_special_tokens`). Unknown fields are
ignored (clients send vendor extras); a known field of the wrong type is a 422.
A value out of range is a 400 that names the field (the error's `param`), as in
vLLM and OpenAI. `check` runs before anything is rendered, tokenized or
allocated for the request, so a hostile body costs no more than its parsing.
Settings we do not implement (penalties, logit bias, echo, suffix) are refused
with a 400 rather than silently ignored: they would change the distribution
the log-probs claim to come from. Client-supplied chat templates are refused:
a template is code, and one with nested loops can run for minutes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from asyncgrpo.inference.engine.types import (
    MAX_PROMPT_LOGPROBS,
    MAX_TOP_LOGPROBS,
    RequestError,
    SamplingParams,
)

MAX_TEMPLATE_KWARGS = 16
MAX_TEMPLATE_KWARG_CHARS = 1024
# Arguments of `apply_chat_template` that are not template variables: they would replace
# the template or change what rendering returns.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "chat_template",
        "conversation",
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "tokenizer_kwargs",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
    }
)


@dataclass(frozen=True)
class RequestLimits:
    """The engine's limits that every request is checked against before any work is done."""

    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    max_request_sequences: int

    @classmethod
    def of(cls, engine) -> RequestLimits:
        config = engine.config
        return cls(
            engine.max_model_len,
            engine.vocab_size,
            config.max_num_seqs,
            config.max_request_sequences,
        )


def check_sequences(prompts: int, n: int, limits: RequestLimits) -> None:
    """Refuse more sequences than one engine request or one HTTP request may ask for."""
    if n > limits.max_num_seqs:
        raise RequestError(f"n={n} exceeds max_num_seqs={limits.max_num_seqs}", 400, "n")
    if prompts * n > limits.max_request_sequences:
        raise RequestError(
            f"this request asks for {prompts} prompt(s) x n={n} = {prompts * n} sequences; "
            f"the limit is max_request_sequences={limits.max_request_sequences}",
            400,
            "n",
        )


def check_context(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """Refuse a prompt plus `max_tokens` beyond the context, as vLLM does."""
    if prompt_tokens + max_tokens > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens (max_model_len is "
            f"{max_model_len}). However, you requested {prompt_tokens + max_tokens} tokens "
            f"({prompt_tokens} in the prompt, {max_tokens} in the completion). Please reduce "
            "the length of the prompt or max_tokens.",
            400,
            "max_tokens",
        )


def refuse_lone_surrogates(param: str, texts: list[str]) -> None:
    """A lone UTF-16 surrogate (JSON allows "\\ud800") is not text: no tokenizer takes it."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError(
                f"{param} contains a lone surrogate (U+D800-U+DFFF), which is not valid Unicode",
                400,
                param,
            ) from None


def _require_at_least_one(param: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise RequestError(f"{param} must be >= 1, got {value}", 400, param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields shared by chat and text completions.

    `prompt_logprobs` (vLLM's): None, or k >= 0 for the log-prob of every prompt token
    given the tokens before it plus the k most likely tokens at each position, under the
    raw model distribution (temperature 1, no top-k or top-p) whatever the sampling
    settings; not with `stream`, as in vLLM.
    """

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def top_logprobs_count(self) -> int:
        return 0

    def check(self, limits: RequestLimits, prompts: int = 1) -> None:
        """Refuse bad values (400 naming the field) before any work is done for the request."""
        _require_at_least_one("max_tokens", self.max_tokens)
        self.check_prompt_logprobs()
        requested = self.requested_max_tokens()
        max_tokens = 1 if requested is None else requested  # the default depends on the prompt
        params = self.sampling_params(max_tokens, self.top_logprobs_count())
        params.validate()
        refuse_lone_surrogates("stop", params.stop)
        if any(not 0 <= t < limits.vocab_size for t in params.stop_token_ids):
            raise RequestError(
                f"stop_token_ids must be in [0, {limits.vocab_size})", 400, "stop_token_ids"
            )
        check_sequences(prompts, self.n, limits)

    def check_prompt_logprobs(self) -> None:
        k = self.prompt_logprobs
        if k is None:
            return
        if not 0 <= k <= MAX_PROMPT_LOGPROBS:
            raise RequestError(
                f"prompt_logprobs must be null or between 0 and {MAX_PROMPT_LOGPROBS}, got {k}",
                400,
                "prompt_logprobs",
            )
        if self.stream:
            raise RequestError(
                "prompt_logprobs are not available when stream=true", 400, "prompt_logprobs"
            )

    def refuse_unsupported(self) -> None:
        if self.presence_penalty or self.frequency_penalty:
            raise RequestError("presence_penalty and frequency_penalty are not supported")
        if self.repetition_penalty not in (None, 1.0):
            raise RequestError("repetition_penalty is not supported")
        if self.logit_bias:
            raise RequestError("logit_bias is not supported")
        if self.best_of not in (None, self.n):
            raise RequestError("best_of is not supported (use n)")

    def sampling_params(self, max_tokens: int, top_logprobs: int) -> SamplingParams:
        self.refuse_unsupported()
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            n=self.n,
            stop=self.stop_strings(),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            top_logprobs=top_logprobs,
            prompt_logprobs=self.prompt_logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(BaseModel):
    """One message; extra keys (e.g. `reasoning_content`) are passed on to the template."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestError("only text content parts are supported")
                texts.append(part["text"])
            message["content"] = "\n".join(texts)
        if self.tool_calls:
            message["tool_calls"] = [_arguments_as_dict(call) for call in self.tool_calls]
        return message


def _arguments_as_dict(call: dict[str, Any]) -> dict[str, Any]:
    """OpenAI sends tool arguments as a JSON string; chat templates expect a mapping."""
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            return call
        return {**call, "function": {**function, "arguments": arguments}}
    return call


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # refused: only the model's own template is rendered

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def top_logprobs_count(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    def check(self, limits: RequestLimits, prompts: int = 1) -> None:
        _require_at_least_one("max_completion_tokens", self.max_completion_tokens)
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(
                f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs}",
                400,
                "top_logprobs",
            )
        self.check_template_kwargs()
        super().check(limits, prompts)

    def check_template_kwargs(self) -> None:
        """Only the model's own template renders; its variables must be small JSON scalars."""
        if self.chat_template is not None:
            raise RequestError(
                "chat_template is not accepted: this server renders only its model's own "
                "chat template",
                400,
                "chat_template",
            )
        kwargs = self.chat_template_kwargs or {}
        if len(kwargs) > MAX_TEMPLATE_KWARGS:
            raise RequestError(
                f"chat_template_kwargs may have at most {MAX_TEMPLATE_KWARGS} keys",
                400,
                "chat_template_kwargs",
            )
        for key, value in kwargs.items():
            _check_template_kwarg(key, value)


def _check_template_kwarg(key: str, value: Any) -> None:
    param = "chat_template_kwargs"
    if key in RESERVED_TEMPLATE_KWARGS:
        raise RequestError(
            f"chat_template_kwargs.{key} is not accepted: this server renders only its "
            "model's own chat template",
            400,
            param,
        )
    if value is not None and not isinstance(value, bool | int | float | str):
        raise RequestError(
            f"chat_template_kwargs.{key} must be a string, number, boolean or null", 400, param
        )
    if len(key) > MAX_TEMPLATE_KWARG_CHARS or len(str(value)) > MAX_TEMPLATE_KWARG_CHARS:
        raise RequestError(
            f"chat_template_kwargs keys and values may have at most "
            f"{MAX_TEMPLATE_KWARG_CHARS} characters",
            400,
            param,
        )


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True

    def top_logprobs_count(self) -> int:
        return self.logprobs or 0

    def check(self, limits: RequestLimits, prompts: int = 1) -> None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(
                f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.logprobs}",
                400,
                "logprobs",
            )
        super().check(limits, prompts)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise RequestError("echo is not supported")
        if self.suffix:
            raise RequestError("suffix is not supported")

    def prompt_list(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        if not p:
            raise RequestError("prompt is empty")
        return list(p)
