"""Tool calls in generated text: parsers per model family, and a fallback for templates without tools.

The engine samples plain tokens; an OpenAI client expects `tool_calls`. A parser
turns the generated text into (content, tool calls, malformed count). Parsers are
chosen by model family from a small registry (`get_parser("hermes")`), so adding
a family is one class. The contract every parser keeps: it never raises, and a
block it cannot read stays in `content` verbatim and is counted as malformed, so
a broken call reaches the model as text (and the metrics) rather than as a 500.

Chat templates that know tools (Qwen, Hermes) render the `tools` list
themselves. Templates that do not (SmolLM2's) would silently drop it; for those,
`inject_tools_fallback` writes the tool descriptions and the exact call format
into the system message and turns earlier assistant tool calls into the same
`<tool_call>` text, so every turn of the conversation renders.
`template_renders_tools` tells the two kinds apart by rendering a probe.

Unlike vLLM's Hermes parser, call ids are derived from a caller-supplied seed
(the completion id) and the call's position, so a replayed request gets the
same ids and two responses never share one.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: `arguments_json` is a JSON object as a string, as OpenAI sends it."""

    id: str
    name: str
    arguments_json: str

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments_json},
        }


class ParseResult(NamedTuple):
    content: str | None
    tool_calls: list[ToolCall]
    malformed: int


class ToolCallParser(Protocol):
    def parse(self, text: str, tools: list[dict] | None = None, id_seed: str = "") -> ParseResult:
        """Split generated `text` into content and tool calls; never raises.

        `tools`: the request's tools; when given, a call naming another tool is
        malformed. `id_seed`: unique per response (e.g. the completion id + choice
        index); call ids are derived from it and the call's position.
        """
        ...


_PARSERS: dict[str, type] = {}


def register_parser(*names: str):
    def decorate(cls: type) -> type:
        for name in names:
            _PARSERS[name] = cls
        return cls

    return decorate


def get_parser(name: str) -> ToolCallParser:
    try:
        return _PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; known: {', '.join(sorted(_PARSERS))}"
        ) from None


def call_id(id_seed: str, index: int) -> str:
    digest = hashlib.sha256(f"{id_seed}\x00{index}".encode()).hexdigest()
    return f"call_{digest[:24]}"


def tool_names(tools: list[dict] | None) -> set[str] | None:
    if tools is None:
        return None
    names = set()
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.add(function["name"])
    return names


def _call_from_json(payload: Any) -> tuple[str, str] | None:
    """(name, arguments as JSON text) from one decoded call object, or None if unreadable."""
    if not isinstance(payload, dict):
        return None
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):  # some models emit the arguments JSON-encoded twice
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


@register_parser("none")
class NoToolParser:
    """For models without tool calling: everything is content."""

    def parse(self, text: str, tools: list[dict] | None = None, id_seed: str = "") -> ParseResult:
        return ParseResult(text, [], 0)


@register_parser("hermes", "qwen", "qwen2", "qwen2.5", "qwen3")
class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, any number.

    A final block left open (the model stopped right after the JSON, e.g. on a
    `</tool_call>` stop string) is accepted when its JSON is complete. A block may
    also hold a JSON list of call objects.
    """

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _decoder = json.JSONDecoder()

    def parse(self, text: str, tools: list[dict] | None = None, id_seed: str = "") -> ParseResult:
        if self.OPEN not in text:
            return ParseResult(text, [], 0)
        allowed = tool_names(tools)
        kept: list[str] = []  # text outside calls, and unreadable blocks verbatim
        calls: list[ToolCall] = []
        malformed = 0
        position = 0
        while (start := text.find(self.OPEN, position)) >= 0:
            kept.append(text[position:start])
            end, found = self._block(text, start + len(self.OPEN), allowed)
            position = end
            if found is None:
                kept.append(text[start:end])
                malformed += 1
                continue
            for name, arguments in found:
                calls.append(ToolCall(call_id(id_seed, len(calls)), name, arguments))
        kept.append(text[position:])
        content = "".join(kept)
        if calls:
            content = content.strip() or None
        return ParseResult(content, calls, malformed)

    def _block(
        self, text: str, body: int, allowed: set[str] | None
    ) -> tuple[int, list[tuple[str, str]] | None]:
        """(end of the block, its calls or None) for the block whose JSON starts at `body`.

        The JSON is decoded in place, so braces or tags inside argument strings
        cannot cut a block short.
        """
        i = _skip_space(text, body)
        try:
            payload, i = self._decoder.raw_decode(text, i)
        except ValueError:
            payload = None
        else:
            i = _skip_space(text, i)
            if text.startswith(self.CLOSE, i) or i == len(text):
                return min(i + len(self.CLOSE), len(text)), _calls_in(payload, allowed)
        close = text.find(self.CLOSE, body)
        return (len(text) if close < 0 else close + len(self.CLOSE)), None


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _calls_in(payload: Any, allowed: set[str] | None) -> list[tuple[str, str]] | None:
    items = payload if isinstance(payload, list) and payload else [payload]
    found = [_call_from_json(item) for item in items]
    if any(call is None for call in found):
        return None
    if allowed is not None and any(name not in allowed for name, _ in found):
        return None
    return found


# ---- templates that do not render tools ----

FALLBACK_HEADER = "# Tools"


def render_tools_fallback(tools: list[dict]) -> str:
    """System-message text describing `tools` and the exact call format (Hermes style)."""
    lines = [
        FALLBACK_HEADER,
        "",
        "You can call the following tools. Each is described by its name, what it "
        "does, and a JSON schema of its arguments.",
        "",
    ]
    functions = [tool.get("function", tool) for tool in tools]
    example_name = functions[0].get("name") if functions else "tool_name"
    for function in functions:
        name = function.get("name", "")
        lines.append(f"## {name}")
        if function.get("description"):
            lines.append(str(function["description"]))
        schema = function.get("parameters") or {"type": "object", "properties": {}}
        lines.append("Arguments schema: " + json.dumps(schema, ensure_ascii=False))
        lines.append("")
    lines += [
        "To call a tool, reply with one block per call, exactly in this form, "
        "with the arguments as a JSON object:",
        '<tool_call>{"name": "' + example_name + '", "arguments": {...}}</tool_call>',
        "You may write several blocks to call several tools. Each result comes back "
        "in a message with the role `tool`. When you need no tool, answer normally.",
    ]
    return "\n".join(lines)


def tool_call_text(call: dict[str, Any]) -> str:
    """An OpenAI tool call (arguments as JSON text or a mapping) as a `<tool_call>` block."""
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    payload = {"name": function.get("name"), "arguments": arguments}
    return HermesParser.OPEN + json.dumps(payload, ensure_ascii=False) + HermesParser.CLOSE


def inject_tools_fallback(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The messages to render with a template that ignores `tools` (a new list).

    The tool description is appended to the system message (or becomes one), and
    assistant tool calls become `<tool_call>` text in their content so that the
    history shows the model the format it is asked to use.
    """
    out = []
    for message in messages:
        message = dict(message)
        if message.get("role") == "assistant" and message.get("tool_calls"):
            blocks = [tool_call_text(call) for call in message.pop("tool_calls")]
            content = message.get("content") or ""
            message["content"] = "\n".join(([content] if content else []) + blocks)
        elif message.get("content") is None:
            message["content"] = ""
        out.append(message)
    if not tools:
        return out
    description = render_tools_fallback(tools)
    if out and out[0].get("role") == "system":
        system = out[0].get("content") or ""
        out[0] = {**out[0], "content": f"{system}\n\n{description}" if system else description}
    else:
        out.insert(0, {"role": "system", "content": description})
    return out


_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "zz_probe_tool_3f9c",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}


def template_renders_tools(tokenizer) -> bool:
    """True if the tokenizer's chat template shows a `tools` list to the model."""
    messages = [{"role": "user", "content": "hi"}]
    try:
        without = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        with_tool = tokenizer.apply_chat_template(
            messages, tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=True
        )
    except Exception:  # no template, or one that raises on tools
        return False
    return with_tool != without and _PROBE_TOOL["function"]["name"] in with_tool
