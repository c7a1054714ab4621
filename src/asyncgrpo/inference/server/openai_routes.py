"""The OpenAI-compatible routes: chat and text completions (streamed or not), models, health.

These routes are open (no token): they are what any `openai` client, agent
framework or benchmark talks to. The server binds to 127.0.0.1 unless told
otherwise. Bad requests are refused before a stream starts, so a client gets a
plain JSON 400 rather than a broken stream, and before any prompt is rendered
or tokenized; rendering and tokenizing run off the event loop (`prompts.py`).

A chat request with `tools` is rendered by `ChatRenderer` (the template's own
tool rendering, or the system-message fallback for templates without it), and
tool calls are parsed out of the generated text with the configured parser
(`ServerSettings.tool_parser`). Such a request, when streamed, is generated to
the end and then sent as chunks: a half-written call cannot be parsed.
"""

from __future__ import annotations

import logging
import time
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from asyncgrpo.inference.engine.types import RequestError
from asyncgrpo.inference.server import openai_format as fmt
from asyncgrpo.inference.server import prompts
from asyncgrpo.inference.server.errors import error_body
from asyncgrpo.inference.server.generation import GenerationJob
from asyncgrpo.inference.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestLimits,
)
from asyncgrpo.inference.server.streaming import (
    ClientDisconnected,
    EventStream,
    cancel_on_disconnect,
    sse,
)

logger = logging.getLogger(__name__)
router = APIRouter()


def served_name(request: Request) -> str:
    return request.app.state.settings.served_model_name or request.app.state.engine.model_name


def check_model(request: Request, model: str | None) -> None:
    """Like vLLM: an unknown model name is a 404 naming it; an omitted one means ours."""
    if model and model not in (served_name(request), request.app.state.engine.model_name):
        raise RequestError(f"The model `{model}` does not exist.", 404)


@router.get("/health")
async def health(request: Request):
    if not request.app.state.engine.is_alive():
        return JSONResponse(error_body("the engine is not running", 503), status_code=503)
    return {"status": "ok"}


@router.get("/v1/models")
async def models(request: Request):
    engine = request.app.state.engine
    return {
        "object": "list",
        "data": [
            {
                "id": served_name(request),
                "object": "model",
                "created": request.app.state.started,
                "owned_by": "asyncgrpo",
                "root": engine.model_name,
                "max_model_len": engine.max_model_len,
            }
        ],
    }


def parse_tool_calls(request: Request, body: ChatCompletionRequest, text: str, id_seed: str):
    """The text split into content and tool calls, or None when the request has no tools."""
    if not body.tools or body.tool_choice == "none":
        return None
    return request.app.state.tool_parser.parse(text, tools=body.tools, id_seed=id_seed)


def chat_response(
    request: Request, body: ChatCompletionRequest, job: GenerationJob, choices, prompt, parsed=None
) -> dict:
    """The `chat.completion` body for finished choices; `parsed`: their tool calls, if known."""
    if parsed is None:
        parsed = [
            parse_tool_calls(request, body, c.text.text, f"{job.id}-{c.index}") for c in choices
        ]
    token_text = fmt.TokenText(request.app.state.engine.tokenizer)
    response = fmt.envelope(
        job.id,
        "chat.completion",
        served_name(request),
        [
            fmt.chat_choice(c, token_text, body.logprobs, body.return_token_ids, p)
            for c, p in zip(choices, parsed)
        ],
    )
    response["usage"] = fmt.usage(job.prompt_tokens(), job.completion_tokens())
    # vLLM's chat shape: one prompt, its prompt log-probs at the top level
    response["prompt_logprobs"] = fmt.prompt_logprobs_json(
        token_text, prompt, choices[0].prompt_logprobs if choices else None
    )
    if body.return_token_ids:
        response["prompt_token_ids"] = prompt
    return response


def stream_of(response: dict, include_usage: bool) -> EventStream:
    """A finished response sent as a stream (for requests whose output must be parsed whole)."""

    async def events():
        for chunk in fmt.chunks_of(response, include_usage):
            yield sse(chunk)
        yield sse("[DONE]")

    return EventStream(events())


def chat_job(engine, body: ChatCompletionRequest, prompt: list[int]) -> GenerationJob:
    """The checked generation job of a chat request whose prompt is already rendered.

    An omitted max_tokens means the rest of the context.
    """
    requested = body.requested_max_tokens()
    max_tokens = max(1, engine.max_model_len - len(prompt)) if requested is None else requested
    params = body.sampling_params(max_tokens, body.top_logprobs_count())
    return GenerationJob(
        engine,
        [prompt],
        params,
        id_prefix="chatcmpl",
        skip_special_tokens=body.skip_special_tokens,
        include_stop=body.include_stop_str_in_output,
    )


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    engine = request.app.state.engine
    check_model(request, body.model)
    limits = RequestLimits.of(engine)
    body.check(limits)
    prompt = await prompts.off_loop(prompts.chat_prompt_ids, engine.tokenizer, body, limits)
    job = chat_job(engine, body, prompt)
    token_text = fmt.TokenText(engine.tokenizer)
    if body.stream and not body.tools:
        return EventStream(_chat_events(job, body, served_name(request), token_text))
    try:
        choices = await cancel_on_disconnect(request, job.run())
    except ClientDisconnected:
        return Response(status_code=499)
    response = chat_response(request, body, job, choices, prompt)
    return stream_of(response, body.include_usage) if body.stream else response


def _chat_events(job: GenerationJob, body: ChatCompletionRequest, model: str, token_text):
    created = int(time.time())
    started: set[int] = set()

    async def events():
        async with aclosing(job.deltas()) as deltas:
            async for choice, delta, piece in deltas:
                message = {"content": piece}
                if choice.index not in started:
                    message = {"role": "assistant", **message}
                entry = {
                    "index": choice.index,
                    "delta": message,
                    "logprobs": fmt.chat_logprobs(
                        token_text,
                        delta.token_ids,
                        delta.logprobs,
                        delta.top_logprobs or [[] for _ in delta.token_ids],
                    )
                    if body.logprobs
                    else None,
                    "finish_reason": delta.finish_reason,
                    "stop_reason": delta.stop_reason,
                    "weight_versions": delta.versions,
                }
                if body.return_token_ids:
                    entry["token_ids"] = delta.token_ids
                chunk = fmt.envelope(job.id, "chat.completion.chunk", model, [entry], created)
                if body.return_token_ids and not started:
                    chunk["prompt_token_ids"] = job.prompts[0]
                started.add(choice.index)
                yield chunk

    return _framed(job, events(), body.include_usage, model, created, "chat.completion.chunk")


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    engine = request.app.state.engine
    check_model(request, body.model)
    limits = RequestLimits.of(engine)
    texts = body.prompt_list()
    body.check(limits, prompts=len(texts))
    prompt_ids = await prompts.off_loop(
        prompts.tokenize_prompts, engine.tokenizer, texts, body.add_special_tokens, limits
    )
    omitted = body.max_tokens is None  # OpenAI's default: 16, cut to fit the context
    params = body.sampling_params(16 if omitted else body.max_tokens, body.top_logprobs_count())
    job = GenerationJob(
        engine,
        prompt_ids,
        params,
        id_prefix="cmpl",
        skip_special_tokens=body.skip_special_tokens,
        include_stop=body.include_stop_str_in_output,
        clamp_to_context=omitted,
    )
    token_text = fmt.TokenText(engine.tokenizer)
    with_logprobs = body.logprobs is not None
    if body.stream:
        return EventStream(_completion_events(job, body, served_name(request), token_text))
    try:
        choices = await cancel_on_disconnect(request, job.run())
    except ClientDisconnected:
        return Response(status_code=499)
    response = fmt.envelope(
        job.id,
        "text_completion",
        served_name(request),
        [
            fmt.completion_choice(
                c, token_text, with_logprobs, body.return_token_ids, prompt_ids[c.prompt_index]
            )
            for c in choices
        ],
    )
    response["usage"] = fmt.usage(job.prompt_tokens(), job.completion_tokens())
    return response


def _completion_events(job: GenerationJob, body: CompletionRequest, model: str, token_text):
    created = int(time.time())
    started: set[int] = set()
    text_offsets: dict[int, int] = {}

    async def events():
        async with aclosing(job.deltas()) as deltas:
            async for choice, delta, piece in deltas:
                entry = {
                    "index": choice.index,
                    "text": piece,
                    "logprobs": None,
                    "finish_reason": delta.finish_reason,
                    "stop_reason": delta.stop_reason,
                    "weight_versions": delta.versions,
                }
                if body.logprobs is not None:
                    offset = text_offsets.get(choice.index, 0)
                    entry["logprobs"] = fmt.completion_logprobs(
                        token_text,
                        delta.token_ids,
                        delta.logprobs,
                        delta.top_logprobs or [[] for _ in delta.token_ids],
                        offset,
                    )
                    text_offsets[choice.index] = offset + sum(
                        len(t) for t in entry["logprobs"]["tokens"]
                    )
                if body.return_token_ids:
                    entry["token_ids"] = delta.token_ids
                    if choice.index not in started:
                        entry["prompt_token_ids"] = job.prompts[choice.prompt_index]
                started.add(choice.index)
                yield fmt.envelope(job.id, "text_completion", model, [entry], created)

    return _framed(job, events(), body.include_usage, model, created, "text_completion")


async def _framed(job, chunks, include_usage: bool, model: str, created: int, kind: str):
    """SSE framing: chunks, then usage (if asked), then [DONE]; errors become an error event."""
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield sse(chunk)
        if include_usage:
            final = fmt.envelope(job.id, kind, model, [], created)
            final["usage"] = fmt.usage(job.prompt_tokens(), job.completion_tokens())
            yield sse(final)
    except RequestError as exc:
        yield sse(error_body(exc.message, exc.status, exc.param))
    except Exception as exc:  # never let one request take the server down
        logger.exception("stream %s failed", job.id)
        yield sse(error_body(f"internal error: {type(exc).__name__}: {exc}", 500))
    yield sse("[DONE]")
