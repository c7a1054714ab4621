"""Plain Python functions as tools: schemas from type hints and docstrings, safe calls.

`tool_schema(fn)` writes the OpenAI function schema a chat template (or the
fallback prompt) shows the model; `ToolBox` runs the calls the model makes.
What the model sends is untrusted text: bad JSON, an unknown tool, a missing,
extra or wrongly-typed argument, an exception or a timeout all come back as an
error string the model reads in its `tool` message, and are counted by kind —
a tool failure is part of the episode, never a crash of the rollout.

Types are checked strictly against the annotations (JSON `1.0` is not an `int`,
`true` is not a number) rather than coerced, so the model is told when it
used the wrong type instead of having it silently fixed.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import types
import typing
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean"}
_ARGS_HEADERS = ("Args:", "Arguments:", "Parameters:")


# ---- schemas ----


def _optional_inner(hint: Any) -> Any | None:
    """X for Optional[X] / X | None; None otherwise."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return args[0]
    return None


def json_schema(hint: Any) -> dict[str, Any]:
    """The JSON schema of a type hint (the subset tools use)."""
    if hint is inspect.Parameter.empty or hint is Any:
        return {}
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    inner = _optional_inner(hint)
    if inner is not None:
        schema = json_schema(inner)
        if isinstance(schema.get("type"), str):
            return {**schema, "type": [schema["type"], "null"]}
        return {"anyOf": [schema, {"type": "null"}]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is list or origin in (list, Sequence):
        return {"type": "array", "items": json_schema(args[0])} if args else {"type": "array"}
    if hint is dict or origin is dict:
        return {"type": "object"}
    if origin is Literal:
        kinds = {_SCALARS.get(type(a)) for a in args}
        schema: dict[str, Any] = {"enum": list(args)}
        if len(kinds) == 1 and None not in kinds:
            schema["type"] = kinds.pop()
        return schema
    raise TypeError(f"unsupported type for a tool argument: {hint!r}")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(summary, {argument: description}) from a Google-style docstring."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    summary: list[str] = []
    for line in lines:
        if not line.strip() or line.strip() in _ARGS_HEADERS:
            break
        summary.append(line.strip())
    described: dict[str, str] = {}
    in_args, current = False, None
    for line in lines:
        stripped = line.strip()
        if stripped in _ARGS_HEADERS:
            in_args, current = True, None
            continue
        if not in_args:
            continue
        if line and not line[0].isspace():  # the next section ("Returns:") or prose
            in_args = False
            continue
        head, sep, rest = stripped.partition(":")
        name = head.split("(")[0].strip()
        if sep and name.isidentifier() and (len(line) - len(line.lstrip())) <= 4:
            current = name
            described[name] = rest.strip()
        elif current and stripped:
            described[current] = f"{described[current]} {stripped}".strip()
    return " ".join(summary), described


def tool_schema(fn: Callable) -> dict[str, Any]:
    """The OpenAI `tools` entry for `fn`: name, docstring summary, argument schema."""
    summary, described = parse_docstring(inspect.getdoc(fn))
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {fn.__name__}: *args and **kwargs cannot be described")
        schema = json_schema(hints.get(name, param.annotation))
        if name in described:
            schema["description"] = described[name]
        if param.default is param.empty:
            required.append(name)
        elif param.default is None or isinstance(param.default, (bool, int, float, str)):
            schema["default"] = param.default
        properties[name] = schema
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": summary,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            },
        },
    }


# ---- argument checks ----


def type_error(value: Any, hint: Any, where: str) -> str | None:
    """None if `value` (decoded JSON) fits `hint`, else what is wrong."""
    if hint is inspect.Parameter.empty or hint is Any:
        return None
    inner = _optional_inner(hint)
    if inner is not None:
        return None if value is None else type_error(value, inner, where)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return None if value in args else f"{where} must be one of {list(args)}, got {value!r}"
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint in (str, bool):
        ok = isinstance(value, hint)
    elif hint is list or origin in (list, Sequence):
        if not isinstance(value, list):
            return f"{where} must be an array, got {type(value).__name__}"
        for i, item in enumerate(value):
            if args and (problem := type_error(item, args[0], f"{where}[{i}]")):
                return problem
        return None
    elif hint is dict or origin is dict:
        ok = isinstance(value, dict)
    else:
        ok = True
    if ok:
        return None
    return f"{where} must be {json_schema(hint).get('type', hint)}, got {type(value).__name__}"


# ---- running calls ----


@dataclass
class ToolResult:
    content: str  # what goes back to the model in the `tool` message
    error: str | None = None  # the failure kind, None on success


@dataclass
class _Tool:
    fn: Callable
    schema: dict[str, Any]
    signature: inspect.Signature
    hints: dict[str, Any]


def _call_parts(tool_call: Any) -> tuple[str, Any]:
    """(name, arguments) from our ToolCall, an OpenAI dict, or an openai SDK object."""
    if isinstance(tool_call, dict):
        function = tool_call.get("function", tool_call)
        return function.get("name"), function.get("arguments", "{}")
    function = getattr(tool_call, "function", None)
    if function is not None:
        return function.name, function.arguments
    return tool_call.name, tool_call.arguments_json


class ToolBox:
    """Python functions the model may call; every failure is counted and reported as text.

    Error kinds (keys of `errors`): invalid_json, unknown_tool, missing_argument,
    unexpected_argument, wrong_type, timeout, exception.
    """

    def __init__(self, fns: Sequence[Callable], timeout: float = 30.0):
        self.timeout = timeout
        self.tools: dict[str, _Tool] = {}
        for fn in fns:
            schema = tool_schema(fn)
            if fn.__name__ in self.tools:
                raise ValueError(f"two tools are named {fn.__name__!r}")
            self.tools[fn.__name__] = _Tool(
                fn, schema, inspect.signature(fn), typing.get_type_hints(fn)
            )
        self.calls = 0
        self.errors: Counter[str] = Counter()

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [tool.schema for tool in self.tools.values()]

    def metrics(self) -> dict[str, int]:
        out = {"tool_calls": self.calls, "tool_failures": sum(self.errors.values())}
        out.update({f"tool_error/{kind}": n for kind, n in sorted(self.errors.items())})
        return out

    async def call(self, tool_call: Any) -> str:
        """Run one call; the text for the model (a result or an error), never raises."""
        return (await self.run(tool_call)).content

    async def run(self, tool_call: Any) -> ToolResult:
        self.calls += 1
        result = await self._run(tool_call)
        if result.error:
            self.errors[result.error] += 1
        return result

    async def respond(self, tool_calls: Sequence[Any]) -> list[dict[str, Any]]:
        """The `tool` messages answering an assistant message's calls (run concurrently)."""
        results = await asyncio.gather(*(self.call(c) for c in tool_calls))
        return [
            {"role": "tool", "tool_call_id": _call_id(c), "content": content}
            for c, content in zip(tool_calls, results)
        ]

    async def _run(self, tool_call: Any) -> ToolResult:
        name, arguments = _call_parts(tool_call)
        tool = self.tools.get(name)
        if tool is None:
            known = ", ".join(self.tools) or "none"
            return ToolResult(f"Error: unknown tool {name!r}; available: {known}.", "unknown_tool")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as exc:
                return ToolResult(f"Error: arguments are not valid JSON ({exc}).", "invalid_json")
        if not isinstance(arguments, dict):
            return ToolResult("Error: arguments must be a JSON object.", "invalid_json")
        problem = self._check(tool, arguments)
        if problem:
            return ToolResult(f"Error: {problem[1]}", problem[0])
        return await self._invoke(tool, name, arguments)

    @staticmethod
    def _check(tool: _Tool, arguments: dict) -> tuple[str, str] | None:
        params = tool.signature.parameters
        extra = sorted(set(arguments) - set(params))
        if extra:
            return (
                "unexpected_argument",
                f"unexpected argument(s) {extra}; expected {list(params)}.",
            )
        missing = [n for n, p in params.items() if p.default is p.empty and n not in arguments]
        if missing:
            return "missing_argument", f"missing required argument(s) {missing}."
        for key, value in arguments.items():
            hint = tool.hints.get(key, params[key].annotation)
            if problem := type_error(value, hint, f"argument {key!r}"):
                return "wrong_type", problem + "."
        return None

    async def _invoke(self, tool: _Tool, name: str, arguments: dict) -> ToolResult:
        try:
            if inspect.iscoroutinefunction(tool.fn):
                value = await asyncio.wait_for(tool.fn(**arguments), self.timeout)
            else:
                value = await asyncio.wait_for(
                    asyncio.to_thread(tool.fn, **arguments), self.timeout
                )
        except TimeoutError:
            return ToolResult(
                f"Error: tool {name!r} timed out after {self.timeout:g} s.", "timeout"
            )
        except Exception as exc:  # the tool's own failure is the model's information
            return ToolResult(f"Error: {name} raised {type(exc).__name__}: {exc}", "exception")
        return ToolResult(_as_text(value))


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def _call_id(tool_call: Any) -> str | None:
    if isinstance(tool_call, dict):
        return tool_call.get("id")
    return getattr(tool_call, "id", None)
