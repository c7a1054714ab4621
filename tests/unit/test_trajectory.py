"""Token-exact trajectories: sampled ids survive every turn, even when decode→encode differs."""

from __future__ import annotations

import pytest

from asyncgrpo.inference.server.toolcalls import ToolCall
from asyncgrpo.inference.server.trajectory import (
    Call,
    ChatRenderer,
    EpisodeResult,
    StopReason,
    TrajectoryBuilder,
    build_samples,
    next_prompt_ids,
)
from asyncgrpo.testing import CHAT_TEMPLATE, build_tiny_tokenizer

# A template that renders tools (Qwen style): tools in the system turn, calls as
# <tool_call> text, consecutive tool results grouped into one user turn.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or loop.previtem.role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A template that drops the reasoning of earlier assistant turns when re-rendering.
DROPS_THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{{ m.content.split('</think>')[-1] }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def base_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture
def tok(base_tokenizer):
    base_tokenizer.chat_template = CHAT_TEMPLATE
    return base_tokenizer


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def char_ids(tok, text):
    """Ids a sampler may well produce: one token per character, never merged."""
    return [i for ch in text for i in encode(tok, ch)]


def render_ids(tok, messages, tools=None):
    return ChatRenderer(tok, tools).prompt_ids(messages)


def sampled_call(tok, messages, completion, version=0, tools=None, reply=None, prompt=None):
    return Call(
        messages=messages,
        prompt_ids=prompt if prompt is not None else render_ids(tok, messages, tools),
        completion_ids=completion,
        logprobs=[-0.5 - 0.01 * i for i in range(len(completion))],
        versions=[version] * len(completion),
        finish_reason="stop",
        reply=reply,
        tools=tools,
    )


def sampled_positions(sample):
    return [t for t, m in enumerate(sample.loss_mask) if m]


def test_decode_encode_is_not_identity_here(tok):
    ids = char_ids(tok, "The answer is 4.")
    assert encode(tok, tok.decode(ids)) != ids  # the premise of the tests below


def two_turns(tok):
    user1 = [{"role": "user", "content": "What is 2+2?"}]
    answer = "The answer is 4."
    completion1 = char_ids(tok, answer) + [tok.convert_tokens_to_ids("<|im_end|>")]
    call1 = sampled_call(
        tok, user1, completion1, version=3, reply={"role": "assistant", "content": answer}
    )
    messages2 = user1 + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Thanks! And 3+3?"},
    ]
    return call1, messages2


def test_retokenized_prompt_still_trains_on_exact_sampled_ids(tok):
    call1, messages2 = two_turns(tok)
    # the engine was given the conversation re-rendered (answer merged into other ids)
    reprompt = render_ids(tok, messages2)
    assert reprompt[: len(call1.prompt_ids) + len(call1.completion_ids)] != (
        call1.prompt_ids + call1.completion_ids
    )
    completion2 = char_ids(tok, "6") + encode(tok, "<|im_end|>")
    call2 = sampled_call(tok, messages2, completion2, version=4, prompt=reprompt)
    builder = TrajectoryBuilder(tok)
    assert builder.add(call1) == 0 and builder.add(call2) == 0
    [sample] = builder.samples()
    bridge = encode(tok, "\n<|im_start|>user\nThanks! And 3+3?<|im_end|>\n<|im_start|>assistant\n")
    expected = call1.prompt_ids + call1.completion_ids + bridge + completion2
    assert sample.input_ids == expected
    assert sample.input_ids != reprompt + completion2  # what re-tokenizing would train on
    assert tok.decode(sample.input_ids) == tok.decode(reprompt + completion2)
    n1 = len(call1.prompt_ids)
    first = list(range(n1, n1 + len(call1.completion_ids)))
    second = list(range(len(expected) - len(completion2), len(expected)))
    assert sampled_positions(sample) == first + second
    assert [sample.logprobs[t] for t in first] == call1.logprobs
    assert [sample.versions[t] for t in second] == [4] * len(completion2)
    assert all(sample.logprobs[t] == 0.0 and sample.versions[t] == -1 for t in range(n1))
    assert builder.prompt_mismatches == 1
    assert sample.min_version == 3


def test_gateway_prefilling_next_prompt_ids_has_no_mismatch(tok):
    call1, messages2 = two_turns(tok)
    builder = TrajectoryBuilder(tok)
    builder.add(call1)
    prompt2 = next_prompt_ids(builder, messages2, tok)
    assert prompt2[: len(call1.prompt_ids) + len(call1.completion_ids)] == (
        call1.prompt_ids + call1.completion_ids
    )
    assert tok.decode(prompt2) == tok.decode(render_ids(tok, messages2))
    completion2 = encode(tok, "6<|im_end|>")
    builder.add(sampled_call(tok, messages2, completion2, prompt=prompt2))
    assert builder.prompt_mismatches == 0
    [sample] = builder.samples()
    assert sample.input_ids == prompt2 + completion2
    # a fresh episode gets the plain rendering
    assert next_prompt_ids(TrajectoryBuilder(tok), messages2) == render_ids(tok, messages2)


def test_turn_cut_by_max_tokens_gets_its_end_of_turn_bridged(tok):
    user1 = [{"role": "user", "content": "Count."}]
    completion1 = char_ids(tok, "1 2 3")  # no <|im_end|>: finish_reason "length"
    call1 = sampled_call(tok, user1, completion1)
    call1.finish_reason = "length"
    messages2 = user1 + [
        {"role": "assistant", "content": "1 2 3"},
        {"role": "user", "content": "Go on."},
    ]
    builder = TrajectoryBuilder(tok)
    builder.add(call1)
    prompt2 = next_prompt_ids(builder, messages2)
    bridge = prompt2[len(call1.prompt_ids) + len(completion1) :]
    assert bridge == encode(tok, "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n") + encode(
        tok, "<|im_start|>assistant\n"
    )


def test_template_that_drops_reasoning_keeps_the_sampled_reasoning(tok):
    tok.chat_template = DROPS_THINKING
    user1 = [{"role": "user", "content": "Hi"}]
    text = "<think>hmm</think>Hello!"
    completion1 = char_ids(tok, text) + encode(tok, "<|im_end|>")
    call1 = sampled_call(tok, user1, completion1, reply={"role": "assistant", "content": text})
    messages2 = user1 + [{"role": "assistant", "content": text}, {"role": "user", "content": "Bye"}]
    reprompt = render_ids(tok, messages2)
    assert "hmm" not in tok.decode(reprompt)
    completion2 = encode(tok, "Bye<|im_end|>")
    samples = build_samples(
        [call1, sampled_call(tok, messages2, completion2, prompt=reprompt)], tok
    )
    [sample] = samples
    assert sample.input_ids[: len(call1.prompt_ids) + len(completion1)] == (
        call1.prompt_ids + completion1
    )
    assert sample.input_ids[-len(completion2) :] == completion2
    assert "hmm" in tok.decode(sample.input_ids)


@pytest.mark.parametrize("renders_tools", [True, False])
def test_tool_turns_bridge_only_the_tool_results(tok, renders_tools):
    if renders_tools:
        tok.chat_template = TOOLS_TEMPLATE
    tools = [WEATHER]
    user1 = [{"role": "user", "content": "Weather in Oslo and Rome?"}]
    calls = [
        ToolCall("call_a", "get_weather", '{"city": "Oslo"}').to_openai(),
        ToolCall("call_b", "get_weather", '{"city": "Rome"}').to_openai(),
    ]
    reply = {"role": "assistant", "content": None, "tool_calls": calls}
    text = "".join(
        '<tool_call>{"name": "get_weather", "arguments": {"city": "' + city + '"}}</tool_call>'
        for city in ("Oslo", "Rome")
    )
    completion1 = char_ids(tok, text) + encode(tok, "<|im_end|>")
    call1 = sampled_call(tok, user1, completion1, tools=tools, reply=reply)
    prompt_text = tok.decode(call1.prompt_ids)
    assert "Weather in a city." in prompt_text
    messages2 = user1 + [
        {"role": "assistant", "content": "", "tool_calls": calls},  # as an SDK echoes it
        {"role": "tool", "tool_call_id": "call_a", "content": "snow"},
        {"role": "tool", "tool_call_id": "call_b", "content": "sun"},
    ]
    builder = TrajectoryBuilder(tok)
    builder.add(call1)
    prompt2 = next_prompt_ids(builder, messages2, tools=tools)
    head = call1.prompt_ids + completion1
    assert prompt2[: len(head)] == head
    bridge_text = tok.decode(prompt2[len(head) :])
    assert "snow" in bridge_text and "sun" in bridge_text and "Oslo" not in bridge_text
    assert bridge_text.endswith("<|im_start|>assistant\n")
    rerendered = tok.decode(render_ids(tok, messages2, tools))
    # the fallback re-renders the two calls on separate lines; the sampled text had none
    assert (tok.decode(prompt2) == rerendered) is renders_tools
    assert rerendered.endswith(bridge_text)
    completion2 = encode(tok, "Snow and sun.<|im_end|>")
    builder.add(sampled_call(tok, messages2, completion2, tools=tools, prompt=prompt2))
    result = builder.result(1.0, "ok", tool_failures=0)
    assert [s.input_ids for s in result.samples] == [prompt2 + completion2]
    assert result.metrics.tool_calls == 2 and result.metrics.turns == 2
    assert result.metrics.prompt_mismatches == 0 and result.metrics.branches == 1


def test_unrelated_conversation_starts_a_branch(tok):
    call1, _ = two_turns(tok)
    other = [{"role": "user", "content": "Hello, world!"}]
    completion = encode(tok, "Hi<|im_end|>")
    builder = TrajectoryBuilder(tok)
    builder.add(call1)
    assert builder.add(sampled_call(tok, other, completion, version=7)) == 1
    samples = builder.samples()
    assert [s.branch_index for s in samples] == [0, 1]
    assert samples[1].input_ids == render_ids(tok, other) + completion
    assert sampled_positions(samples[1]) == list(
        range(len(samples[1].input_ids) - len(completion), len(samples[1].input_ids))
    )
    assert samples[1].versions[-1] == 7


def test_edited_reply_or_changed_tools_is_not_a_continuation(tok):
    call1, messages2 = two_turns(tok)
    edited = [dict(m) for m in messages2]
    edited[1]["content"] = "The answer is 5."
    completion = encode(tok, "ok<|im_end|>")
    builder = TrajectoryBuilder(tok)
    builder.add(call1)
    assert builder.add(sampled_call(tok, edited, completion)) == 1
    assert builder.add(sampled_call(tok, messages2, completion, tools=[WEATHER])) == 2
    assert builder.prompt_mismatches == 0


def test_template_that_refuses_the_history_starts_a_branch_instead_of_failing(tok):
    call1, messages2 = two_turns(tok)
    builder = TrajectoryBuilder(tok)
    builder.add(call1)
    tok.chat_template = (
        "{% if messages[-1].role == 'assistant' %}{{ raise_exception('no') }}{% endif %}"
        + CHAT_TEMPLATE
    )
    reprompt = render_ids(tok, messages2)
    assert builder.add(sampled_call(tok, messages2, encode(tok, "6"), prompt=reprompt)) == 1
    assert builder.prompt_mismatches == 0


def test_without_tokenizer_only_token_prefixes_extend(tok):
    call1, messages2 = two_turns(tok)
    call2 = sampled_call(tok, messages2, encode(tok, "6<|im_end|>"))
    assert len(build_samples([call1, call2])) == 2
    exact = sampled_call(
        tok,
        messages2,
        encode(tok, "6<|im_end|>"),
        prompt=call1.prompt_ids + call1.completion_ids + encode(tok, "\nmore"),
    )
    assert len(build_samples([call1, exact])) == 1


def test_fork_from_an_earlier_turn_shares_the_exact_prefix(tok):
    call1, messages2 = two_turns(tok)
    builder = TrajectoryBuilder(tok)
    builder.add(call1)
    prompt2 = next_prompt_ids(builder, messages2)
    builder.add(sampled_call(tok, messages2, encode(tok, "6<|im_end|>"), prompt=prompt2))
    retry = messages2[:2] + [{"role": "user", "content": "Sure? 3+3?"}]
    prompt3 = next_prompt_ids(builder, retry)
    head = call1.prompt_ids + call1.completion_ids
    assert prompt3[: len(head)] == head
    assert builder.add(sampled_call(tok, retry, encode(tok, "6!<|im_end|>"), prompt=prompt3)) == 1
    samples = builder.samples()
    assert len(samples) == 2
    # the first answer is trained once: in branch 0, context (mask 0) in branch 1
    assert all(samples[1].loss_mask[t] == 0 for t in range(len(head)))


def test_branch_that_prefixes_another_is_merged_not_repeated(tok):
    user = [{"role": "user", "content": "Hi"}]
    prompt = render_ids(tok, user)
    answer = encode(tok, "Hello!<|im_end|>")
    longer = sampled_call(tok, user, encode(tok, "Yo<|im_end|>"), version=2)
    longer.prompt_ids = prompt + answer + encode(tok, "\n<|im_start|>user\nHow?<|im_end|>\n")
    short = sampled_call(tok, user, answer, version=1, prompt=prompt)
    duplicate = sampled_call(tok, user, answer, version=5, prompt=prompt)
    samples = build_samples([longer, short, duplicate])
    [sample] = samples
    assert sample.branch_index == 0
    assert sample.input_ids == longer.prompt_ids + longer.completion_ids
    n = len(prompt)
    assert sampled_positions(sample) == list(range(n, n + len(answer))) + list(
        range(len(sample.input_ids) - len(longer.completion_ids), len(sample.input_ids))
    )
    assert [sample.versions[t] for t in range(n, n + len(answer))] == [1] * len(answer)
    assert sample.logprobs[n] == short.logprobs[0]


def test_versions_carry_per_token(tok):
    call1, messages2 = two_turns(tok)
    call1.versions = [3] * (len(call1.versions) - 2) + [4, 4]  # weights swapped mid-turn
    builder = TrajectoryBuilder(tok)
    builder.add(call1)
    prompt2 = next_prompt_ids(builder, messages2)
    call2 = sampled_call(tok, messages2, encode(tok, "6<|im_end|>"), prompt=prompt2)
    call2.versions = [5, 6]
    builder.add(call2)
    [sample] = builder.samples()
    assert [sample.versions[t] for t in sampled_positions(sample)] == call1.versions + [5, 6]
    assert sample.min_version == 3


def test_stop_reasons_and_result():
    assert {r.value for r in StopReason} == {
        "ok",
        "max_turns",
        "timeout",
        "length",
        "tool_error",
        "infra_error",
        "reward_error",
    }
    assert StopReason("timeout").trainable and not StopReason.INFRA_ERROR.trainable
    assert not EpisodeResult(None, StopReason.OK, []).trainable
    builder = TrajectoryBuilder()
    result = builder.result(0.5, "infra_error")
    assert result.stop_reason is StopReason.INFRA_ERROR and not result.trainable
    with pytest.raises(RuntimeError, match="closed"):
        builder.add(Call([], [1], [2], [0.0], [0], "stop"))


def test_call_rejects_misaligned_records():
    with pytest.raises(ValueError, match="log-probs"):
        Call([], [1], [2, 3], [0.0], [0, 0], "stop")


def test_engine_episode_log_probs_reproduce_on_the_training_sequence(tiny_model_dir):
    """Three turns sampled by the real engine from a random model (so sampled BPE pieces
    rarely re-encode to themselves): a forward pass over each sample reproduces the
    engine's log-prob at every trained position, i.e. the trained context is exact."""
    import asyncio

    import torch
    from transformers import AutoModelForCausalLM

    from asyncgrpo.base.config import EmbeddedEngineConfig
    from asyncgrpo.inference.engine.engine import Engine
    from asyncgrpo.inference.engine.types import SamplingParams

    engine = Engine(
        EmbeddedEngineConfig(model=str(tiny_model_dir), dtype="float32", max_num_seqs=4)
    )
    tok = engine.tokenizer
    builder = TrajectoryBuilder(tok)
    messages = [{"role": "user", "content": "What is 12 + 7?"}]
    retokenized = 0

    async def sample(prompt):
        ids, logprobs, versions, finish = [], [], [], None
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=len(prompt))
        async for delta in engine.generate(prompt, params):
            ids += delta.token_ids
            logprobs += delta.logprobs
            versions += delta.versions
            finish = delta.finish_reason or finish
        return ids, logprobs, versions, finish

    engine.start()
    try:
        for turn in range(3):
            prompt = next_prompt_ids(builder, messages)
            ids, logprobs, versions, finish = asyncio.run(sample(prompt))
            text = tok.decode(ids, skip_special_tokens=True)
            retokenized += encode(tok, text) != [i for i in ids if i != tok.eos_token_id]
            reply = {"role": "assistant", "content": text}
            builder.add(Call(messages, prompt, ids, logprobs, versions, finish, reply=reply))
            messages = messages + [reply, {"role": "user", "content": f"And {turn} more?"}]
    finally:
        engine.shutdown()
    assert retokenized > 0  # the premise: text round trips would have changed the ids
    [sample_] = builder.samples()
    assert builder.prompt_mismatches == 0
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([sample_.input_ids])).logits[0], dim=-1)
    positions = sampled_positions(sample_)
    assert len(positions) == sum(len(c.completion_ids) for c in builder.calls)
    recomputed = [logp[t - 1, sample_.input_ids[t]].item() for t in positions]
    expected = [sample_.logprobs[t] for t in positions]
    assert recomputed == pytest.approx(expected, abs=1e-4)
