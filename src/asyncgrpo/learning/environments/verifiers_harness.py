"""asyncgrpo's harness for verifiers 0.4 environments: the chat loop, run in the trainer's process.

In verifiers 0.4 the agent of an episode is a program that a harness launches in a runtime.
verifiers' own minimal loops (`null`, and `bash`, which adds a shell on the host) are one
script that `uv sync --script` provisions from the package index on first use, then run as
one Python process per episode: a network dependency, and about a second of CPU per episode
before the first token. verifiers states the contract as "the interception is the contract,
not the process" (`Harness.launch`): a harness may run its loop in-process if every model
call goes through the rollout's interception endpoint. This one does: a coroutine on the
environment's event loop (`verifiers_v1_host`), so an episode costs no process, no network,
and its turns are recorded by verifiers (trace, `@stop`s, limits) and by the episode gateway
(the engine's tokens) alike.

The loop: the system prompt and the task's prompt (a string, or messages), the taskset's
MCP tools (the MCP SDK's client, no TLS context for loopback servers); each reply's tool
calls run one after the other and come back as tool messages; a reply without a call ends
the segment. The model calls go through one OpenAI client per interception endpoint on the
environment's loop, kept across segments and episodes (`model_client`: its connections
stay open, and a client costs no construction per segment); each call carries its own
rollout's secret, which is how the interception server tells rollouts apart. The env's host
closes them as it stops (`close_clients`). A refused
turn (a `@stop`, `max_turns`) ends it too, as it ends verifiers' loop. The model's mistakes
(arguments that are not a JSON object, an unknown tool, a tool that reports an error) are
error tool messages it reads, counted in `trace.info["tool_failures"]`; a tool server that
cannot be reached is the environment's failure.

Departs from verifiers' `null` loop: calls are not streamed; no context compaction (a
prompt the context cannot hold ends the segment, as `null` does with compaction off); no
tool-call gate (`SUPPORTS_TOOL_INTERCEPTION` is False, so a task's request-side `@stop`
ends the rollout rather than denying one call).

verifiers finds a harness by importing the module named after its id, top-level; `register`
makes this module importable as `asyncgrpo_chat`, the module of the id `asyncgrpo-chat`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import weakref
from contextlib import AsyncExitStack
from typing import Any

import httpx
import openai
import verifiers.v1 as vf
from pydantic import Field
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.mcp import mcp_content_to_chat_content

__all__ = ["HARNESS_ID", "InProcessChatConfig", "InProcessChatHarness", "close_clients", "register"]

HARNESS_ID = "asyncgrpo-chat"
MODULE_NAME = "asyncgrpo_chat"  # the module verifiers imports for HARNESS_ID
# the model clients of each event loop, by (endpoint, call deadline, retries)
_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple, openai.AsyncOpenAI]]
_CLIENTS = weakref.WeakKeyDictionary()


def register() -> None:
    """Make `HARNESS_ID` loadable by verifiers (`vf.load_harness`) in this process."""
    sys.modules.setdefault(MODULE_NAME, sys.modules[__name__])


class InProcessChatConfig(vf.HarnessConfig):
    id: str = HARNESS_ID
    call_timeout_s: float | None = Field(None, gt=0)
    """Deadline of one model call (None: none; the episode's own timeout still applies)."""
    max_retries: int = Field(2, ge=0)
    """The OpenAI client's retries of a call that failed in transport or with a 5xx."""


class InProcessChatHarness(vf.Harness[InProcessChatConfig]):
    """The chat loop as a coroutine (see the module docstring)."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True  # a user turn relaunches the loop on the conversation so far
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
    ) -> vf.ProgramResult:
        system_prompt, prompt = self.resolve_prompt(data)
        messages = opening_messages(system_prompt, prompt)
        client = self.model_client(endpoint)
        async with AsyncExitStack() as stack:
            tools = await ToolBelt.connect(mcp_urls, self.config.tool_timeout, stack)
            try:
                await converse(client, ctx.model, messages, tools, trace, secret)
            except openai.APIStatusError as exc:
                if context_exhausted(exc):
                    return vf.ProgramResult(0, "", "")  # the context is full: the segment ends
                # a refused turn (the trace is stopped), or a failed model call whose cause
                # verifiers kept (the rollout records that one rather than this exit)
                return vf.ProgramResult(1, "", f"{type(exc).__name__}: {exc}")
        return vf.ProgramResult(0, "", "")

    def model_client(self, endpoint: str) -> openai.AsyncOpenAI:
        """The running loop's OpenAI client of `endpoint` (see the module docstring)."""
        clients = _CLIENTS.setdefault(asyncio.get_running_loop(), {})
        key = (endpoint, self.config.call_timeout_s, self.config.max_retries)
        if key not in clients:
            clients[key] = openai.AsyncOpenAI(
                base_url=endpoint,
                api_key="per-call",  # each call sends its rollout's secret (`converse`)
                max_retries=self.config.max_retries,
                timeout=httpx.Timeout(self.config.call_timeout_s, connect=30.0),
                http_client=openai.DefaultAsyncHttpxClient(
                    verify=not endpoint.startswith("http://")  # no TLS context for loopback
                ),
            )
        return clients[key]


async def close_clients() -> None:
    """Close the running loop's model clients (`model_client`)."""
    for client in _CLIENTS.pop(asyncio.get_running_loop(), {}).values():
        await client.close()


def opening_messages(system_prompt: str | None, prompt: Any) -> list[dict[str, Any]]:
    """The conversation a segment starts from, as chat-completions messages."""
    messages: list[dict[str, Any]] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    elif prompt is not None:
        messages.extend(message_to_wire(m) for m in prompt)
    return messages


def context_exhausted(exc: openai.APIStatusError) -> bool:
    """The endpoint refused the prompt as longer than the model's context."""
    text = str(exc).lower()
    return exc.status_code == 413 or (
        exc.status_code == 400 and ("max_model_len" in text or "context length" in text)
    )


async def converse(
    client: openai.AsyncOpenAI,
    model: str,
    messages: list[dict[str, Any]],
    tools: ToolBelt,
    trace: vf.Trace,
    secret: str,
) -> None:
    """Reply, run the reply's tool calls, repeat, until a reply calls no tool; every call
    authenticated by the rollout's `secret`."""
    extra: dict[str, Any] = {"extra_headers": {"Authorization": f"Bearer {secret}"}}
    if tools.schemas:
        extra["tools"] = tools.schemas
    while True:
        completion = await client.chat.completions.create(model=model, messages=messages, **extra)
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return
        for call in message.tool_calls:
            content, failed = await tools.run(call.function.name, call.function.arguments)
            if failed:
                trace.info["tool_failures"] = trace.info.get("tool_failures", 0) + 1
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                 "content": content}
            )  # fmt: skip


class ToolBelt:
    """The rollout's MCP tools: their schemas for the model, and calls to them.

    One MCP client per tool server for the segment, opened and closed in the segment's own
    task (the MCP SDK's AnyIO scopes require it); tools are named as verifiers' own loop
    names them (`<server>_<tool>`, or the bare tool of a server without a prefix).
    """

    def __init__(self) -> None:
        self.schemas: list[dict[str, Any]] = []
        self.dispatch: dict[str, tuple[Any, str]] = {}  # model-facing name -> (client, tool)

    @classmethod
    async def connect(cls, urls: dict[str, str], timeout: float, stack: AsyncExitStack):
        belt = cls()
        for server, url in urls.items():
            client = await stack.enter_async_context(_mcp_client(url, timeout))
            for tool in (await client.list_tools()).tools:
                name = f"{server}_{tool.name}" if server else tool.name
                if name in belt.dispatch:
                    raise ValueError(f"two tool servers offer a tool named {name!r}")
                belt.dispatch[name] = (client, tool.name)
                function = {"name": name, "description": tool.description or ""}
                function["parameters"] = tool.input_schema
                belt.schemas.append({"type": "function", "function": function})
        return belt

    async def run(self, name: str, arguments: str | None) -> tuple[Any, bool]:
        """(the tool message's content, whether the call failed as the model's mistake)."""
        try:
            parsed = json.loads(arguments or "{}")
        except json.JSONDecodeError as exc:
            return f"error: the arguments are not valid JSON ({exc})", True
        if not isinstance(parsed, dict):
            return "error: the arguments must be a JSON object", True
        if name not in self.dispatch:
            known = ", ".join(sorted(self.dispatch)) or "none"
            return f"error: there is no tool named {name!r} (tools: {known})", True
        client, tool = self.dispatch[name]
        result = await client.call_tool(tool, parsed)
        return mcp_content_to_chat_content(result.content), bool(result.is_error)


@contextlib.asynccontextmanager
async def _mcp_client(url: str, timeout: float):
    """An MCP client of the streamable-HTTP server at `url` (no TLS context for loopback)."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    deadlines = httpx2.Timeout(timeout, connect=5.0)
    verify = not url.startswith("http://")
    async with (
        httpx2.AsyncClient(timeout=deadlines, follow_redirects=True, verify=verify) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        yield client
