"""Request parsing and checks: chat rendering with tools, content parts, prompts, refused
settings and values, the bounds that keep one request from hurting the others."""

import pytest

from asyncgrpo.inference.engine.types import RequestError, SamplingParams
from asyncgrpo.inference.server.prompts import (
    check_text_fits,
    longest_token_chars,
    render_chat,
    tokenize_prompts,
)
from asyncgrpo.inference.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestLimits,
)
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
    text = render_chat(tokenizer, request)
    assert text == "<tools>calc;</tools><user>add\nit<assistant>[calc:3]<tool>3<assistant>"


def test_template_errors_and_image_parts_are_400s(tokenizer):
    image = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        }
    )
    with pytest.raises(RequestError, match="only text"):
        render_chat(tokenizer, image)
    broken = build_tiny_tokenizer()
    broken.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(RequestError, match="no system role"):
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
        with pytest.raises(RequestError):
            CompletionRequest(prompt="x", **bad).sampling_params(4, 0)


LIMITS = RequestLimits(max_model_len=64, vocab_size=512, max_num_seqs=8, max_request_sequences=16)


def refusal(request, limits=LIMITS, prompts=1) -> RequestError:
    with pytest.raises(RequestError) as info:
        request.check(limits, prompts)
    assert info.value.status == 400
    return info.value


def test_zero_max_tokens_is_refused_not_read_as_missing():
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_tokens=0)
    assert refusal(chat).param == "max_tokens"
    chat = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], max_completion_tokens=0, max_tokens=9
    )
    assert refusal(chat).param == "max_completion_tokens"
    assert refusal(CompletionRequest(prompt="x", max_tokens=0)).param == "max_tokens"


def test_sampling_values_are_range_checked_and_tiny_temperatures_allowed():
    for field, value in [
        ("temperature", float("nan")),
        ("temperature", float("-inf")),
        ("top_p", float("nan")),
        ("top_k", 2**63),
        ("seed", 2**63),
        ("n", 0),
    ]:
        error = refusal(CompletionRequest(prompt="x", **{field: value}))
        assert error.param == field and field in error.message
    CompletionRequest(prompt="x", temperature=1e-40, seed=2**63 - 1, top_k=-1).check(LIMITS)
    SamplingParams(temperature=1e-40).validate()


def test_prompt_logprobs_are_bounded_and_reach_the_engine_settings():
    for value, stream in [(21, False), (-1, False), (2, True)]:
        error = refusal(CompletionRequest(prompt="x", prompt_logprobs=value, stream=stream))
        assert error.param == "prompt_logprobs" and "prompt_logprobs" in error.message
    with pytest.raises(RequestError) as engine_refusal:
        SamplingParams(prompt_logprobs=21).validate()
    assert engine_refusal.value.param == "prompt_logprobs"
    for value in (None, 0, 20):
        request = CompletionRequest(prompt="x", prompt_logprobs=value)
        request.check(LIMITS)
        assert request.sampling_params(4, 0).prompt_logprobs == value


def test_sequences_per_request_are_bounded_before_anything_is_built():
    assert "max_num_seqs=8" in refusal(CompletionRequest(prompt="x", n=9)).message
    error = refusal(CompletionRequest(prompt=["a", "b", "c"], n=8), prompts=3)
    assert "24 sequences" in error.message and "max_request_sequences=16" in error.message
    CompletionRequest(prompt=["a", "b"], n=8).check(LIMITS, prompts=2)


def test_stop_lists_are_bounded_and_must_be_text():
    assert "at most 16" in refusal(CompletionRequest(prompt="x", stop=["a"] * 17)).message
    assert refusal(CompletionRequest(prompt="x", stop="s" * 257)).param == "stop"
    assert refusal(CompletionRequest(prompt="x", stop=["\ud800"])).param == "stop"
    assert refusal(CompletionRequest(prompt="x", stop_token_ids=[512])).param == "stop_token_ids"
    assert refusal(CompletionRequest(prompt="x", stop_token_ids=[0] * 65)).param == (
        "stop_token_ids"
    )


def test_client_templates_are_refused_and_template_kwargs_bounded():
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for kwargs in (
        {"chat_template": "{{ 1 }}"},
        {"tokenize": True},
        {"nested": {"a": 1}},
        {"long": "x" * 2000},
        {f"k{i}": 1 for i in range(17)},
    ):
        request = ChatCompletionRequest(**chat, chat_template_kwargs=kwargs)
        assert refusal(request).param == "chat_template_kwargs"
    top_level = ChatCompletionRequest(**chat, chat_template="{{ 1 }}")
    assert refusal(top_level).param == "chat_template"
    ChatCompletionRequest(**chat, chat_template_kwargs={"enable_thinking": False}).check(LIMITS)


def test_size_bound_never_refuses_a_text_that_fits(tokenizer):
    """len(text) / longest token string is a lower bound on the token count."""
    longest = longest_token_chars(tokenizer)
    texts = [
        "Hello, world! How are you",
        "ünïcödé ✓ 漢字 🙂" * 5,
        "<|im_start|>user\nhi<|im_end|>" * 3,
        " " * 40 + "x" * 40,
    ]
    for text in texts:
        assert len(tokenizer(text)["input_ids"]) >= len(text) / longest
    with pytest.raises(RequestError, match="max_model_len is 64") as info:
        check_text_fits(tokenizer, 64 * longest + 1, "prompt", 64)
    assert info.value.param == "prompt"
    check_text_fits(tokenizer, 63 * longest, "prompt", 64)


def test_prompts_are_size_checked_before_tokenizing(tokenizer):
    calls = []

    class CountingTokenizer:
        def get_vocab(self):
            return tokenizer.get_vocab()

        def __call__(self, text, add_special_tokens):
            calls.append(text)
            return tokenizer(text, add_special_tokens=add_special_tokens)

    counting = CountingTokenizer()
    too_long = "x" * (64 * longest_token_chars(tokenizer) + 1)
    with pytest.raises(RequestError, match="max_model_len is 64"):
        tokenize_prompts(counting, [too_long], True, LIMITS)
    with pytest.raises(RequestError, match="surrogate"):
        tokenize_prompts(counting, ["a\udfffb"], True, LIMITS)
    assert calls == []
    assert tokenize_prompts(counting, ["hi", [3, 4]], False, LIMITS)[1] == [3, 4]
