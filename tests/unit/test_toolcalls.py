"""Tool-call parsing, the fallback tool prompt, and template detection."""

from __future__ import annotations

import json

import pytest

from asyncgrpo.inference.server.toolcalls import (
    ToolCall,
    get_parser,
    inject_tools_fallback,
    render_tools_fallback,
    template_renders_tools,
)
from asyncgrpo.testing import build_tiny_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}


def parse(text, **kwargs):
    return get_parser("hermes").parse(text, **kwargs)


def test_single_call_and_surrounding_text():
    content, calls, malformed = parse(
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>"
    )
    assert content == "Let me check."
    assert malformed == 0
    assert [(c.name, json.loads(c.arguments_json)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert calls[0].to_openai()["function"]["arguments"] == calls[0].arguments_json
    assert calls[0].to_openai()["type"] == "function"


def test_multiple_calls_ids_unique_and_deterministic():
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
        " and "
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    _, calls, _ = parse(text, id_seed="chatcmpl-1/0")
    again = parse(text, id_seed="chatcmpl-1/0").tool_calls
    other = parse(text, id_seed="chatcmpl-2/0").tool_calls
    assert [c.name for c in calls] == ["a", "b"]
    assert len({c.id for c in calls}) == 2
    assert [c.id for c in calls] == [c.id for c in again]
    assert not {c.id for c in calls} & {c.id for c in other}
    assert all(c.id.startswith("call_") for c in calls)
    assert parse(text).content == "and"


def test_no_call_returns_text_unchanged():
    assert parse("  plain answer\n") == ("  plain answer\n", [], 0)
    assert get_parser("none").parse("<tool_call>{}</tool_call>").tool_calls == []


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"a": ',  # cut off by max_tokens
        "<tool_call>[]</tool_call>",
    ],
)
def test_malformed_blocks_stay_in_content_and_are_counted(block):
    content, calls, malformed = parse("before " + block)
    assert calls == []
    assert malformed == 1
    assert content == "before " + block


def test_malformed_next_to_good_call():
    good = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    bad = "<tool_call>{oops}</tool_call>"
    content, calls, malformed = parse(f"{bad}\n{good}")
    assert [c.name for c in calls] == ["f"]
    assert malformed == 1
    assert content == bad


def test_nested_braces_and_tags_inside_strings():
    arguments = {"code": "def f():\n    return {'a': {'b': 1}}", "note": "</tool_call> {"}
    text = "<tool_call>" + json.dumps({"name": "run", "arguments": arguments}) + "</tool_call>"
    content, calls, malformed = parse(text)
    assert malformed == 0 and content is None
    assert json.loads(calls[0].arguments_json) == arguments


def test_unicode_arguments_kept_readable():
    text = '<tool_call>{"name": "translate", "arguments": {"text": "héllo 世界 🌍"}}</tool_call>'
    _, calls, _ = parse(text)
    assert "世界 🌍" in calls[0].arguments_json
    assert json.loads(calls[0].arguments_json) == {"text": "héllo 世界 🌍"}


def test_unclosed_final_block_with_complete_json_is_a_call():
    _, calls, malformed = parse('<tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert malformed == 0 and [c.name for c in calls] == ["f"]


def test_string_arguments_and_list_payload():
    _, calls, _ = parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>')
    assert json.loads(calls[0].arguments_json) == {"a": 2}
    _, calls, _ = parse(
        '<tool_call>[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]</tool_call>'
    )
    assert [c.name for c in calls] == ["f", "g"]


def test_names_validated_against_request_tools():
    text = '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>'
    content, calls, malformed = parse(text, tools=[WEATHER])
    assert (calls, malformed, content) == ([], 1, text)
    assert parse(text).tool_calls[0].name == "launch_rockets"


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="hermes"):
        get_parser("nope")
    assert isinstance(get_parser("qwen"), type(get_parser("hermes")))


def test_fallback_text_has_schema_and_format():
    text = render_tools_fallback([WEATHER])
    assert "get_weather" in text and "Current weather in a city." in text
    assert json.dumps(WEATHER["function"]["parameters"]) in text
    assert '<tool_call>{"name": "get_weather", "arguments": {...}}</tool_call>' in text
    # what the fallback teaches is what the parser reads
    example = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    assert parse(example, tools=[WEATHER]).tool_calls[0].name == "get_weather"


def test_inject_merges_into_system_and_renders_history():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                ToolCall("call_1", "get_weather", '{"city": "Paris"}').to_openai(),
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    out = inject_tools_fallback(messages, [WEATHER])
    assert messages[2]["tool_calls"]  # input untouched
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert out[2]["content"] == (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    )
    assert "tool_calls" not in out[2]
    no_system = inject_tools_fallback(messages[1:], [WEATHER])
    assert no_system[0]["role"] == "system" and "get_weather" in no_system[0]["content"]
    tokenizer = build_tiny_tokenizer()
    rendered = tokenizer.apply_chat_template(out, tokenize=False, add_generation_prompt=True)
    assert "sunny" in rendered and "Arguments schema" in rendered


def test_template_detection():
    tokenizer = build_tiny_tokenizer()
    assert template_renders_tools(tokenizer) is False
    tokenizer.chat_template = (
        "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
        + tokenizer.chat_template
    )
    assert template_renders_tools(tokenizer) is True
    tokenizer.chat_template = None
    assert template_renders_tools(tokenizer) is False
