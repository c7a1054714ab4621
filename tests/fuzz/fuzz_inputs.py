"""Hostile inputs the OpenAPI schema cannot know about: extreme values, strategies, examples.

The schema says `n` is an integer and `temperature` a number; it does not say
that `n = 321589181` once made the server allocate 24 GB, that `top_k = 2**63`
overflowed inside sampling, that `temperature = 1e-40` produced NaN log-probs,
or that a client-supplied chat template ran on the event loop. These values, found by
probing the server with hostile requests, are mixed into small, otherwise valid
requests, both as Hypothesis strategies and as named examples (one test each, so
every failure shows by name).

Generation requests keep `max_tokens` small unless `max_tokens` is the value
under test, so the suite's time stays bounded.
"""

from __future__ import annotations

import hypothesis.strategies as st

NAN, INF = float("nan"), float("inf")
EXTREME_INTS = [0, -1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64]
EXTREME_INTS += [-(2**63), -(2**64) - 1, 10**30, 321_589_181]
EXTREME_COUNTS = [0, -1, 64, 65, 256, 257, 10**6, 2 * 10**6, 321_589_181, 2**63]
EXTREME_FLOATS = [NAN, INF, -INF, 1e-40, -1e-40, 5e-324, 1e-300, 1e308, -1.0, -0.0, 0.0]
EXTREME_FLOATS += [1.0000001, 2.0, 1e6]
EXTREME_MAX_TOKENS = [0, -1, 2**31, 2**63, 10**30, 10**6, 129]
LONE_SURROGATES = ["\ud800", "\udfff", "a\ud800b", "\udbff\udbff", "\udc00x"]
CLIENT_TEMPLATES = {
    "nested_loops": "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}"
    "{% endfor %}",
    "string_bomb": "{{ 'x' * 1000000000 }}",
    "content_amplifier": "{% for m in messages %}{{ m['content'] * 10000000 }}{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "sandbox_escape": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "syntax_error": "{% for %}",
    "raises": "{{ raise_exception('boom') }}",
}
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


def huge_text() -> str:
    """15 MB of text, just under the default 16 MiB body limit."""
    return "The quick brown fox jumps over the lazy dog. " * 333_000


def repeated(element: st.SearchStrategy, most: int) -> st.SearchStrategy:
    """A long list of one drawn element (long lists without Hypothesis's size limits)."""
    return st.tuples(element, st.integers(1, most)).map(lambda pair: [pair[0]] * pair[1])


def with_hostile_fields(valid: st.SearchStrategy, hostile: dict) -> st.SearchStrategy:
    """A valid request with up to three of its fields replaced by hostile values."""
    names = st.lists(st.sampled_from(sorted(hostile)), max_size=3, unique=True)
    overrides = names.flatmap(lambda keys: st.fixed_dictionaries({k: hostile[k] for k in keys}))
    return st.tuples(valid, overrides).map(lambda pair: {**pair[0], **pair[1]})


# ---- valid requests: most reach the engine, so the bystander shares batches with them ----

short_texts = st.text(min_size=1, max_size=24)
token_ids = st.lists(st.integers(0, 400), min_size=1, max_size=48)
valid_sampling = {
    "n": st.integers(1, 4),
    "temperature": st.floats(0.0, 2.0),
    "top_p": st.floats(0.05, 1.0),
    "top_k": st.integers(0, 600),
    "seed": st.integers(0, 2**32),
    "stop": st.lists(st.text(min_size=1, max_size=5), max_size=4),
    "stop_token_ids": st.lists(st.integers(0, 400), max_size=4),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "return_token_ids": st.booleans(),
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
}
valid_completion = st.fixed_dictionaries(
    {
        "prompt": st.one_of(short_texts, token_ids, st.lists(token_ids, min_size=1, max_size=3)),
        "max_tokens": st.integers(1, 8),
    },
    optional={**valid_sampling, "logprobs": st.integers(0, 5)},
)
valid_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": short_texts}
)
valid_chat = st.fixed_dictionaries(
    {"messages": st.lists(valid_message, min_size=1, max_size=4), "max_tokens": st.integers(1, 8)},
    optional={
        **valid_sampling,
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 5),
        "tools": st.just([CALCULATOR]),
        "chat_template_kwargs": st.sampled_from([{}, {"enable_thinking": False}]),
        "add_generation_prompt": st.booleans(),
    },
)

# ---- hostile field values ----

surrogate_texts = st.one_of(
    st.sampled_from(LONE_SURROGATES), short_texts.map(lambda s: s + "\ud800")
)
texts = st.one_of(st.text(max_size=40), surrogate_texts)
long_texts = st.integers(1_000, 100_000).map(lambda k: "ab " * k)
hostile_ints = st.sampled_from(EXTREME_INTS)
hostile_floats = st.sampled_from(EXTREME_FLOATS)
hostile_sampling = {
    "n": st.sampled_from(EXTREME_COUNTS),
    "max_tokens": st.sampled_from(EXTREME_MAX_TOKENS),
    "temperature": hostile_floats,
    "top_p": hostile_floats,
    "top_k": hostile_ints,
    "seed": hostile_ints,
    "stop": st.one_of(surrogate_texts, repeated(texts, 20_000), long_texts),
    "stop_token_ids": st.one_of(
        st.lists(hostile_ints, min_size=1, max_size=4), repeated(st.integers(0, 400), 50_000)
    ),
    "logit_bias": st.dictionaries(st.text(max_size=4), hostile_floats, min_size=1, max_size=3),
}
hostile_completion = {
    **hostile_sampling,
    "prompt": st.one_of(
        surrogate_texts,
        long_texts,
        st.sampled_from(["", [], [[]]]),
        st.lists(hostile_ints, min_size=1, max_size=4),
        repeated(st.text(max_size=8), 3000),
        repeated(token_ids, 3000),
    ),
    "logprobs": hostile_ints,
    "echo": st.just(True),
}
hostile_message = st.fixed_dictionaries(
    {
        "role": st.one_of(texts, st.just("tool")),
        "content": st.one_of(
            texts,
            long_texts,
            st.none(),
            st.lists(
                st.fixed_dictionaries({"type": texts, "text": st.one_of(texts, hostile_ints)})
            ),
        ),
    },
    optional={
        "name": texts,
        "tool_call_id": texts,
        "tool_calls": st.lists(st.dictionaries(texts, texts)),
    },
)
hostile_chat = {
    **hostile_sampling,
    "messages": st.one_of(
        st.lists(hostile_message, min_size=1, max_size=3), repeated(valid_message, 5000)
    ),
    "max_completion_tokens": st.sampled_from(EXTREME_MAX_TOKENS),
    "top_logprobs": hostile_ints,
    "chat_template_kwargs": st.one_of(
        st.sampled_from(sorted(CLIENT_TEMPLATES.values())).map(lambda t: {"chat_template": t}),
        st.dictionaries(texts, st.one_of(texts, hostile_ints, st.booleans()), max_size=3),
        st.sampled_from([{"tokenize": True}, {"messages": 5}, {"add_generation_prompt": "yes"}]),
    ),
    "tools": st.lists(st.dictionaries(texts, texts), max_size=3),
    "continue_final_message": st.just(True),
}

completion_bodies = with_hostile_fields(valid_completion, hostile_completion)
chat_bodies = with_hostile_fields(valid_chat, hostile_chat)


# ---- named examples: (id, route, body); route "episode" is an episode's chat route ----
# Bodies of megabytes are built when their test runs (callables), not when tests are collected.


def completion(**fields) -> dict:
    return {"prompt": [1, 2, 3], "max_tokens": 4, **fields}


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}


COMPLETIONS, CHAT, EPISODE = "/v1/completions", "/v1/chat/completions", "episode"

GENERATION_EXAMPLES = [
    ("n_321589181", COMPLETIONS, completion(prompt=[1], n=321_589_181)),
    ("n_1e6_float", COMPLETIONS, completion(n=1e6)),
    ("n_2e6_chat", CHAT, chat(n=2_000_000)),
    ("n_0", COMPLETIONS, completion(n=0)),
    ("n_negative", CHAT, chat(n=-1)),
    ("prompts_2000_x_n_64", COMPLETIONS, completion(prompt=[[1, 2]] * 2000, n=64)),
    ("prompts_100k", COMPLETIONS, lambda: completion(prompt=["a"] * 100_000)),
    ("top_k_2pow63", COMPLETIONS, completion(top_k=2**63)),
    ("top_k_2pow64_chat", CHAT, chat(top_k=2**64)),
    ("top_k_negative_2pow63", COMPLETIONS, completion(top_k=-(2**63))),
    ("seed_2pow64", COMPLETIONS, completion(seed=2**64)),
    ("seed_2pow63_chat", CHAT, chat(seed=2**63)),
    ("seed_negative", COMPLETIONS, completion(seed=-1)),
    ("max_tokens_0_chat", CHAT, chat(max_tokens=0)),
    ("max_tokens_0", COMPLETIONS, completion(max_tokens=0)),
    ("max_tokens_negative", COMPLETIONS, completion(max_tokens=-1)),
    ("max_tokens_2pow31_chat", CHAT, chat(max_tokens=2**31)),
    ("max_tokens_2pow63", COMPLETIONS, completion(max_tokens=2**63)),
    ("max_tokens_1e30", COMPLETIONS, completion(max_tokens=10**30)),
    ("max_completion_tokens_0", CHAT, chat(max_completion_tokens=0)),
    ("temperature_nan", CHAT, chat(temperature=NAN)),
    ("temperature_inf", COMPLETIONS, completion(temperature=INF)),
    ("temperature_minus_inf", CHAT, chat(temperature=-INF)),
    ("temperature_negative", COMPLETIONS, completion(temperature=-1.0)),
    ("temperature_1e308", COMPLETIONS, completion(temperature=1e308, logprobs=2)),
    ("temperature_1e-40_logprobs", CHAT, chat(temperature=1e-40, logprobs=True, top_logprobs=3)),
    ("temperature_1e-40_completion", COMPLETIONS, completion(temperature=1e-40, logprobs=3)),
    ("temperature_1e-40_stream", CHAT, chat(temperature=1e-40, logprobs=True, stream=True)),
    ("top_p_nan", COMPLETIONS, completion(top_p=NAN)),
    ("top_p_inf", CHAT, chat(top_p=INF)),
    ("top_p_0", COMPLETIONS, completion(top_p=0.0, logprobs=2)),
    ("top_p_negative", COMPLETIONS, completion(top_p=-0.5)),
    ("top_p_1e-40_logprobs", CHAT, chat(top_p=1e-40, logprobs=True, top_logprobs=5)),
    ("top_p_half_top_logprobs", CHAT, chat(top_p=0.5, logprobs=True, top_logprobs=5)),
    ("top_p_tenth_stream", COMPLETIONS, completion(top_p=0.1, logprobs=5, stream=True)),
    ("top_logprobs_2pow31", CHAT, chat(logprobs=True, top_logprobs=2**31)),
    ("logprobs_1e6", COMPLETIONS, completion(logprobs=10**6)),
    ("prompt_15MB", COMPLETIONS, lambda: completion(prompt=huge_text())),
    ("chat_content_15MB", CHAT, lambda: chat(messages=[{"role": "user", "content": huge_text()}])),
    ("messages_100k", CHAT, lambda: chat(messages=[{"role": "user", "content": "a"}] * 100_000)),
    (
        "stop_1M_strings_n_16",
        COMPLETIONS,
        lambda: completion(stop=["x"] * 1_000_000, n=16, max_tokens=16),
    ),
    ("stop_one_10MB_string", COMPLETIONS, lambda: completion(stop="ab" * 5_000_000)),
    ("stop_token_ids_1M", COMPLETIONS, lambda: completion(stop_token_ids=list(range(1_000_000)))),
    ("stop_token_ids_2pow63", CHAT, chat(stop_token_ids=[2**63])),
    ("prompt_token_1e9", COMPLETIONS, completion(prompt=[10**9])),
    ("prompt_token_negative", COMPLETIONS, completion(prompt=[-1])),
    ("prompt_token_2pow64", COMPLETIONS, completion(prompt=[2**64])),
    ("prompt_lone_surrogate", COMPLETIONS, completion(prompt="\ud800")),
    ("prompt_list_lone_surrogate", COMPLETIONS, completion(prompt=["ok", "a\udfffb"])),
    ("chat_lone_surrogate", CHAT, chat(messages=[{"role": "user", "content": "\ud800"}])),
    ("role_lone_surrogate", CHAT, chat(messages=[{"role": "\ud800", "content": "hi"}])),
    ("stop_lone_surrogate", COMPLETIONS, completion(stop=["\udfff"])),
    ("model_lone_surrogate", CHAT, chat(model="\ud800")),
    ("content_part_not_text", CHAT, chat(messages=[{"role": "user", "content": [{"type": 1}]}])),
    ("tools_malformed", CHAT, chat(tools=[{"type": "function"}] * 1000)),
    ("template_kwarg_tokenize", CHAT, chat(chat_template_kwargs={"tokenize": True})),
    ("logit_bias_huge", CHAT, lambda: chat(logit_bias={str(i): 1.0 for i in range(100_000)})),
    (
        "n_64_stream_usage",
        COMPLETIONS,
        completion(n=64, stream=True, stream_options={"include_usage": True}),
    ),
    ("episode_n_321589181", EPISODE, chat(n=321_589_181)),
    ("episode_temperature_nan", EPISODE, chat(temperature=NAN)),
    ("episode_max_tokens_0", EPISODE, chat(max_tokens=0)),
    ("episode_lone_surrogate", EPISODE, chat(messages=[{"role": "user", "content": "\udfff"}])),
    ("episode_top_k_2pow63", EPISODE, chat(top_k=2**63)),
]
GENERATION_EXAMPLES += [
    (f"template_{name}", CHAT, chat(chat_template_kwargs={"chat_template": template}))
    for name, template in CLIENT_TEMPLATES.items()
]
GENERATION_EXAMPLES += [
    (
        "template_nested_loops_tools",
        CHAT,
        chat(
            tools=[CALCULATOR],
            chat_template_kwargs={"chat_template": CLIENT_TEMPLATES["nested_loops"]},
        ),
    ),
    (
        "episode_template_nested_loops",
        EPISODE,
        chat(chat_template_kwargs={"chat_template": CLIENT_TEMPLATES["nested_loops"]}),
    ),
]

# ---- admin routes: (id, setup steps, method, path, body); "{fifo}" is a named pipe ----

SHM_DESCRIPTION = {"names": ["model.embed_tokens.weight"], "dtype_names": ["uint8"]}
SHM_DESCRIPTION |= {"shapes": [[8]], "offsets": [0]}
INIT_SHM = ("POST", "/init_weight_transfer_engine", {"init_info": {"backend": "shm"}})
INIT_DISK = ("POST", "/init_weight_transfer_engine", {"init_info": {"backend": "disk"}})
START = ("POST", "/start_weight_update", {})

ADMIN_EXAMPLES = [
    (
        "shm_etc_passwd",
        [INIT_SHM, START],
        "POST",
        "/update_weights",
        {"update_info": {"path": "/etc/passwd", **SHM_DESCRIPTION}},
    ),
    (
        "shm_etc_passwd_finish",
        [
            INIT_SHM,
            START,
            (
                "POST",
                "/update_weights",
                {"update_info": {"path": "/etc/passwd", **SHM_DESCRIPTION}},
            ),
        ],
        "POST",
        "/finish_weight_update",
        {},
    ),
    (
        "shm_fifo",
        [INIT_SHM, START],
        "POST",
        "/update_weights",
        {"update_info": {"path": "{fifo}", **SHM_DESCRIPTION}},
    ),
    (
        "disk_fifo",
        [INIT_DISK, START],
        "POST",
        "/update_weights",
        {"update_info": {"path": "{fifo}"}},
    ),
    ("disk_root", [INIT_DISK, START], "POST", "/update_weights", {"update_info": {"path": "/"}}),
    (
        "disk_proc_self",
        [INIT_DISK, START],
        "POST",
        "/update_weights",
        {"update_info": {"path": "/proc/self/mem"}},
    ),
    (
        "finish_version_2pow64",
        [INIT_DISK, START],
        "POST",
        "/finish_weight_update",
        {"weight_version": 2**64},
    ),
    ("pause_bad_mode", [], "POST", "/pause?mode=bogus", None),
    ("open_episode_turns_2pow64", [], "POST", "/episodes", {"max_turns": 2**64}),
    ("close_unknown_long_id", [], "POST", "/episodes/" + "x" * 10_000 + "/close", {}),
    ("episode_info_dots", [], "GET", "/episodes/..%2F..%2Fhealth", None),
]
