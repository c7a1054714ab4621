"""Python functions as tools: schemas, argument checks, and failures returned as text."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Literal, Optional

import pytest

from asyncgrpo.inference.server.toolcalls import ToolCall
from asyncgrpo.learning.agents.tools import ToolBox, tool_schema


def search(
    query: str,
    limit: int = 5,
    scale: float = 1.0,
    exact: bool = False,
    tags: list[str] | None = None,
    order: Literal["asc", "desc"] = "asc",
    page: Optional[int] = None,  # noqa: UP045 (the old spelling must work too)
) -> list[str]:
    """Search the notes for a query.

    Results are ranked by relevance.

    Args:
        query: What to look for.
        limit (int): At most this many
            results, best first.
        scale: Score multiplier.
        exact: Only exact matches.
        tags: Restrict to these tags.
        order: Sort order.
        page: Page number.

    Returns:
        The matching notes.
    """
    return [query] * limit


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def slow(seconds: float) -> str:
    """Sleep, then answer."""
    await asyncio.sleep(seconds)
    return "done"


def blocking(seconds: float) -> str:
    """Block a thread, then answer."""
    time.sleep(seconds)
    return "done"


def broken() -> str:
    """Always fails."""
    raise RuntimeError("disk on fire")


def test_schema_from_hints_and_docstring():
    schema = tool_schema(search)
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "search"
    assert function["description"] == "Search the notes for a query."
    params = function["parameters"]
    assert params["required"] == ["query"]
    props = params["properties"]
    assert props["query"] == {"type": "string", "description": "What to look for."}
    assert props["limit"] == {
        "type": "integer",
        "description": "At most this many results, best first.",
        "default": 5,
    }
    assert props["scale"]["type"] == "number"
    assert props["exact"]["type"] == "boolean"
    assert props["tags"]["type"] == ["array", "null"]
    assert props["tags"]["items"] == {"type": "string"}
    assert props["order"]["enum"] == ["asc", "desc"] and props["order"]["type"] == "string"
    assert props["page"]["type"] == ["integer", "null"]
    assert "Returns" not in json.dumps(schema)
    json.dumps(schema)  # serialisable


def test_schema_refuses_what_it_cannot_describe():
    def star(*args: int) -> None:
        pass

    def weird(x: complex) -> None:
        pass

    with pytest.raises(TypeError):
        tool_schema(star)
    with pytest.raises(TypeError):
        tool_schema(weird)


def run(coro):
    return asyncio.run(coro)


def test_calls_succeed_with_every_call_shape():
    box = ToolBox([add, search])
    assert [s["function"]["name"] for s in box.schemas] == ["add", "search"]
    assert run(box.call(ToolCall("call_1", "add", '{"a": 2, "b": 3}'))) == "5"
    assert run(
        box.call({"id": "x", "function": {"name": "add", "arguments": '{"a":1,"b":1}'}})
    ) == ("2")
    assert json.loads(run(box.call(ToolCall("c", "search", '{"query": "é", "limit": 2}')))) == [
        "é",
        "é",
    ]
    assert box.metrics() == {"tool_calls": 3, "tool_failures": 0}


@pytest.mark.parametrize(
    ("name", "arguments", "kind"),
    [
        ("add", '{"a": 1, "b": ', "invalid_json"),
        ("add", "[1, 2]", "invalid_json"),
        ("subtract", "{}", "unknown_tool"),
        ("add", '{"a": 1}', "missing_argument"),
        ("add", '{"a": 1, "b": 2, "c": 3}', "unexpected_argument"),
        ("add", '{"a": 1, "b": "2"}', "wrong_type"),
        ("add", '{"a": 1.5, "b": 2}', "wrong_type"),
        ("add", '{"a": true, "b": 2}', "wrong_type"),
        ("search", '{"query": "q", "order": "sideways"}', "wrong_type"),
        ("search", '{"query": "q", "tags": ["a", 1]}', "wrong_type"),
        ("broken", "{}", "exception"),
    ],
)
def test_failures_become_text_and_are_counted(name, arguments, kind):
    box = ToolBox([add, search, broken])
    result = run(box.run(ToolCall("c", name, arguments)))
    assert result.error == kind
    assert result.content.startswith("Error")
    assert box.errors == {kind: 1}
    assert box.metrics()["tool_failures"] == 1
    assert box.metrics()[f"tool_error/{kind}"] == 1


def test_error_text_helps_the_model():
    box = ToolBox([add, broken])
    assert "available: add, broken" in run(box.call(ToolCall("c", "mul", "{}")))
    assert "disk on fire" in run(box.call(ToolCall("c", "broken", "{}")))
    assert "'b'" in run(box.call(ToolCall("c", "add", '{"a": 1}')))


def test_optional_accepts_null_and_empty_arguments_mean_none():
    box = ToolBox([search, broken])
    assert run(box.run(ToolCall("c", "search", '{"query": "q", "page": null}'))).error is None
    assert run(box.run(ToolCall("c", "broken", ""))).error == "exception"


def test_timeouts_for_async_and_thread_tools():
    box = ToolBox([slow, blocking], timeout=0.05)
    start = time.monotonic()
    assert run(box.run(ToolCall("c", "slow", '{"seconds": 5}'))).error == "timeout"
    assert run(box.run(ToolCall("c", "blocking", '{"seconds": 0.3}'))).error == "timeout"
    assert time.monotonic() - start < 1.0
    assert run(box.call(ToolCall("c", "slow", '{"seconds": 0}'))) == "done"
    assert box.errors == {"timeout": 2}


def test_respond_runs_calls_concurrently_and_keeps_ids():
    box = ToolBox([slow])
    calls = [ToolCall(f"call_{i}", "slow", '{"seconds": 0.2}').to_openai() for i in range(5)]
    start = time.monotonic()
    messages = run(box.respond(calls))
    assert time.monotonic() - start < 0.8
    assert [m["tool_call_id"] for m in messages] == [f"call_{i}" for i in range(5)]
    assert all(m["role"] == "tool" and m["content"] == "done" for m in messages)
