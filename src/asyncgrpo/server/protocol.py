"""Request bodies of the OpenAI routes, as pydantic models, and their sampling settings.

Field names follow the OpenAI API plus vLLM's extensions that RL needs
(`top_k`, `stop_token_ids`, `ignore_eos`, `return_token_ids`,
`include_stop_str_in_output`, `skip_special_tokens`). Unknown fields are
ignored (clients send vendor extras); a known field of the wrong type is a 422.
Settings we do not implement (penalties, logit bias, echo, suffix) are refused
with a 400 rather than silently ignored: they would change the distribution
the log-probs claim to come from.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from asyncgrpo.engine.types import EngineError, SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields shared by chat and text completions."""

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

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    def refuse_unsupported(self) -> None:
        if self.presence_penalty or self.frequency_penalty:
            raise EngineError("presence_penalty and frequency_penalty are not supported")
        if self.repetition_penalty not in (None, 1.0):
            raise EngineError("repetition_penalty is not supported")
        if self.logit_bias:
            raise EngineError("logit_bias is not supported")
        if self.best_of not in (None, self.n):
            raise EngineError("best_of is not supported (use n)")

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
                    raise EngineError("only text content parts are supported")
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

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def top_logprobs_count(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise EngineError("echo is not supported")
        if self.suffix:
            raise EngineError("suffix is not supported")

    def prompt_list(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        if not p:
            raise EngineError("prompt is empty")
        return list(p)


def render_chat(tokenizer, request: ChatCompletionRequest) -> list[int]:
    """Render messages (and tools) with the model's chat template, then tokenize."""
    messages = [m.for_template() for m in request.messages]
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=request.tools,
            tokenize=False,
            add_generation_prompt=request.add_generation_prompt
            and not request.continue_final_message,
            continue_final_message=request.continue_final_message,
            **(request.chat_template_kwargs or {}),
        )
    except Exception as exc:  # jinja errors, templates that raise on bad roles, ...
        raise EngineError(f"cannot render the chat template: {exc}") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_prompt(tokenizer, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
    return list(prompt)
