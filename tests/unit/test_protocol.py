"""Request parsing: chat rendering with tools, content parts, prompts, refused settings."""

import pytest

from asyncgrpo.engine.types import EngineError
from asyncgrpo.server.protocol import ChatCompletionRequest, CompletionRequest, render_chat
from asyncgrpo.testing import build_tiny_tokenizer

TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] or '' }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "[{{ c['function']['name'] }}:{{ c['function']['arguments']['x'] }}]{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tiny_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    return tok


def test_tools_content_parts_and_tool_arguments_reach_the_template(tokenizer):
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "add"}, {"type": "text", "text": "it"}],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "1",
                            "type": "function",
                            "function": {"name": "calc", "arguments": '{"x": 3}'},
                        }
                    ],
                },
                {"role": "tool", "content": "3", "tool_call_id": "1"},
            ],
            "tools": [{"type": "function", "function": {"name": "calc", "parameters": {}}}],
        }
    )
    ids = render_chat(tokenizer, request)
    text = tokenizer.decode(ids)
    assert text == "<tools>calc;</tools><user>add\nit<assistant>[calc:3]<tool>3<assistant>"


def test_template_errors_and_image_parts_are_400s(tokenizer):
    image = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        }
    )
    with pytest.raises(EngineError, match="only text"):
        render_chat(tokenizer, image)
    broken = build_tiny_tokenizer()
    broken.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(EngineError, match="no system role"):
        render_chat(
            broken,
            ChatCompletionRequest.model_validate(
                {"messages": [{"role": "system", "content": "x"}]}
            ),
        )


def test_prompt_forms_and_sampling_settings():
    assert CompletionRequest(prompt="hi").prompt_list() == ["hi"]
    assert CompletionRequest(prompt=[1, 2]).prompt_list() == [[1, 2]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompt_list() == [[1], [2, 3]]
    assert CompletionRequest(prompt=["a", "b"]).prompt_list() == ["a", "b"]
    params = CompletionRequest(prompt="x", top_k=5, stop="END", seed=3, n=2).sampling_params(9, 1)
    assert (params.top_k, params.stop, params.seed, params.n, params.max_tokens) == (
        5,
        ["END"],
        3,
        2,
        9,
    )
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.top_logprobs == 1
    chat = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], logprobs=False, top_logprobs=4
    )
    assert chat.top_logprobs_count() == 0
    for bad in ({"echo": True}, {"logit_bias": {"1": 2.0}}, {"frequency_penalty": 0.5}):
        with pytest.raises(EngineError):
            CompletionRequest(prompt="x", **bad).sampling_params(4, 0)
