"""TRL's `tools=` / `environment_factory=` rules (trl 1.16's GRPOTrainer, read from its
source), checked against hand-written expectations: which members are tools, what reset
does to the prompt, what reward functions and get_reward see, which failures are the
environment's (infra_error) and which are user mistakes caught before the start."""

from __future__ import annotations

import asyncio
import copy
from types import SimpleNamespace

import pytest

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.base.config import ConfigError
from asyncgrpo.base.episode import BranchSequence, StopReason
from asyncgrpo.learning.agents.rollout_api import EnvironmentFailure
from asyncgrpo.learning.agents.runner import EpisodeOutcome
from asyncgrpo.learning.agents.tools import ToolBox
from asyncgrpo.learning.environments.trl import TrlRollout, trl_source, with_observation
from asyncgrpo.learning.environments.trl_classes import read_environment, read_environments
from asyncgrpo.learning.rollout.rewards import RewardRunner


class Shop:
    """A TRL-style environment: the tools below, plus members that are not tools."""

    calls: list = []  # noqa: RUF012 - test bookkeeping

    def __init__(self):
        self.stock = {}
        self.asked = []

    def reset(self, **row):
        self.stock = dict(row.get("stock", {}))
        return f" (shop has {len(self.stock)} items)"

    def count(self, item: str) -> int:
        """How many of an item are in stock.

        Args:
            item: the item's name
        """
        self.asked.append(item)
        return self.stock.get(item, 0)

    async def restock(self, item: str, amount: int = 1) -> str:
        """Add items to the stock."""
        self.stock[item] = self.stock.get(item, 0) + amount
        return "ok"

    @staticmethod
    def catalogue() -> list:
        """Every item sold here."""
        return ["apple", "pear"]

    @classmethod
    def build(cls):  # a classmethod: not a tool in TRL (not a function on the class)
        return cls()

    @property
    def size(self) -> int:  # a property: not a tool
        return len(self.stock)

    def _secret(self) -> int:  # private: not a tool
        return 1

    def get_reward(self) -> float:
        return float(len(self.asked))


def test_public_functions_other_than_reset_and_get_reward_are_the_tools():
    kind = read_environment(None, Shop)
    assert kind.tool_names == ("catalogue", "count", "restock")  # sorted, as getmembers lists
    assert kind.has_reward
    rollout = TrlRollout([kind], [], 4, {})
    env = Shop()
    toolbox = ToolBox([getattr(env, n) for n in kind.tool_names])
    schemas = {s["function"]["name"]: s["function"] for s in toolbox.schemas}
    assert schemas["count"]["description"] == "How many of an item are in stock."
    assert schemas["count"]["parameters"]["properties"] == {
        "item": {"type": "string", "description": "the item's name"}
    }
    assert schemas["count"]["parameters"]["required"] == ["item"]  # no `self`
    assert schemas["restock"]["parameters"]["required"] == ["item"]
    assert schemas["restock"]["parameters"]["properties"]["amount"] == {
        "type": "integer",
        "default": 1,
    }
    assert rollout.kind_of({"prompt": "x"}) is kind


def test_factory_mistakes_are_config_errors_before_anything_runs():
    class NeedsArgs:
        def __init__(self, size):
            self.size = size

        def reset(self, **row):
            return None

    class NoReset:
        def act(self) -> str:
            return ""

    class BadHint:
        def reset(self, **row):
            return None

        def act(self, thing: object) -> str:
            """Do it."""
            return ""

    with pytest.raises(ConfigError, match="not an instance"):
        read_environment(None, Shop())
    with pytest.raises(ConfigError, match=r"needs the arguments \['size'\]"):
        read_environment(None, NeedsArgs)
    with pytest.raises(ConfigError, match="no `reset`"):
        read_environment(None, NoReset)
    with pytest.raises(ConfigError, match="act cannot be a tool"):
        read_environment(None, BadHint)
    with pytest.raises(ConfigError, match="empty mapping"):
        read_environments({})
    # a zero-argument function is a factory too (TRL accepts any callable): its class is probed
    assert read_environment(None, lambda: Shop()).cls is Shop


def test_trainer_refuses_a_run_without_any_reward_source():
    class Plain:
        def reset(self, **row):
            return None

    args = AsyncGRPOConfig(max_steps=1)
    with pytest.raises(ConfigError, match="no reward source"):
        AsyncGRPOTrainer(model="x", environment_factory=Plain, train_dataset=[], args=args)
    with pytest.raises(ConfigError, match="needs a train_dataset"):
        AsyncGRPOTrainer(model="x", reward_funcs=[len], environment_factory={"a": Shop}, args=args)
    AsyncGRPOTrainer(model="x", environment_factory=Shop, args=args)  # get_reward suffices


def test_reset_text_is_appended_to_the_last_user_message_and_the_row_is_untouched():
    prompt = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "How many apples?"},
    ]
    out = with_observation(prompt, " (3 items)")
    assert out == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "How many apples? (3 items)"},
    ]
    assert prompt[1]["content"] == "How many apples?"
    assert with_observation(prompt, None) is prompt
    assert with_observation("plain", "!") == "plain!"
    with pytest.raises(EnvironmentFailure):
        with_observation(prompt, 3)


def test_max_tool_calling_iterations_is_max_turns_minus_one():
    assert AsyncGRPOConfig(max_tool_calling_iterations=0).agent.max_turns == 1
    assert AsyncGRPOConfig(max_tool_calling_iterations=4).agent.max_turns == 5
    with pytest.raises(ConfigError, match="max_tool_calling_iterations"):
        AsyncGRPOConfig(max_tool_calling_iterations=-1)


# ---- a rollout against a scripted model -------------------------------------------------


def _reply(content, calls=(), finish="stop"):
    from openai.types.chat import ChatCompletion

    tool_calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(calls)
    ]
    message = {"role": "assistant", "content": content, "tool_calls": tool_calls or None}
    return ChatCompletion.model_validate(
        {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        }
    )


class ScriptedLLM:
    """`llm.client()` whose chat.completions.create replays `replies`, recording requests."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.requests = []
        self.model = "m"

    def client(self):
        llm = self

        class Client:
            async def __aenter__(self):
                return self

            async def __aexit__(self, *exc):
                return False

            chat = SimpleNamespace(completions=SimpleNamespace(create=None))

        async def create(**kwargs):
            llm.requests.append(copy.deepcopy(kwargs))  # the messages list grows later
            return llm.replies.pop(0)

        Client.chat = SimpleNamespace(completions=SimpleNamespace(create=create))
        return Client()


def run(coro):
    return asyncio.run(coro)


def test_a_rollout_resets_calls_tools_in_order_and_leaves_the_last_calls_unrun():
    kind = read_environment(None, Shop)
    rollout = TrlRollout([kind], [], 3, {"max_tokens": 9})
    llm = ScriptedLLM(
        [
            _reply(None, [("count", '{"item": "apple"}'), ("restock", '{"item": "apple"}')]),
            _reply("", [("count", '{"item": 3}')]),  # wrong type: an error text, counted
            _reply("", [("count", '{"item": "pear"}')]),  # the last turn: not run (TRL)
        ]
    )
    row = {"prompt": [{"role": "user", "content": "Count."}], "stock": {"apple": 2}}
    result = run(rollout(row, llm))
    episode = result.context
    assert result.stop_reason == StopReason.MAX_TURNS and result.reward is None
    assert result.tool_failures == 1
    assert episode.environment.asked == ["apple"]  # pear was never asked
    assert episode.environment.stock == {"apple": 3}
    first = llm.requests[0]
    assert first["messages"] == [{"role": "user", "content": "Count. (shop has 1 items)"}]
    assert first["max_tokens"] == 9
    assert {t["function"]["name"] for t in first["tools"]} == {"catalogue", "count", "restock"}
    roles = [m["role"] for m in episode.completion]
    assert roles == ["assistant", "tool", "tool", "assistant", "tool", "assistant"]
    assert episode.completion[0]["tool_calls"][0] == {
        "type": "function",
        "function": {"name": "count", "arguments": {"item": "apple"}},
    }
    assert episode.completion[1] == {"role": "tool", "name": "count", "content": "2"}
    assert episode.completion[4]["content"].startswith("Error:")
    assert episode.reward == 1.0  # get_reward ran as the episode ended


def test_constructor_reset_and_get_reward_failures_are_the_environments():
    class Broken(Shop):
        fail = "reset"

        def __init__(self):
            if self.fail == "init":
                raise OSError("no sandbox")
            super().__init__()

        def reset(self, **row):
            if self.fail == "reset":
                raise KeyError("task")
            return None

        def get_reward(self) -> float:
            raise RuntimeError("judge down")

    for fail in ("init", "reset", None):
        Broken.fail = fail
        rollout = TrlRollout([read_environment(None, Broken)], [], 2, {})
        with pytest.raises(EnvironmentFailure):
            run(rollout({"prompt": "hi"}, ScriptedLLM([_reply("done")])))


def _outcome(episode, ids):
    n = 2 + len(ids)
    sample = BranchSequence([1, 2, *ids], [0, 0, *[1] * len(ids)], [0.0] * n, [0] * n, 0)
    return EpisodeOutcome(None, StopReason.OK, [sample], context=episode)


def test_reward_functions_get_trl_keywords_and_get_reward_adds_a_column():
    class Other:
        def reset(self, **row):
            return None

    seen = {}

    def solved(prompts, completions, completion_ids, environments, stock, **kw):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, stock=stock)
        seen["environments"] = environments
        return [1.0 if isinstance(e, Shop) else 0.0 for e in environments]

    cfg = AsyncGRPOConfig(**{"advantage.reward_weights": [0.5]})
    runner = RewardRunner([solved])
    source = trl_source(cfg, runner, None, {"shop": Shop, "other": Other})
    assert source.scorer.names == ["solved", "Shop"]
    assert cfg.advantage.reward_weights == [0.5, 1.0]  # TRL: get_reward has weight 1
    row = {"prompt": [{"role": "user", "content": "Q"}], "stock": {"a": 1}}
    episodes = []
    for name, replies in (("shop", [_reply("A")]), ("other", [_reply("B")])):
        result = run(source.rollout({**row, "environment": name}, ScriptedLLM(replies)))
        episodes.append(result.context)
    values = run(
        source.scorer.score(row, [_outcome(episodes[0], [5]), _outcome(episodes[1], [6, 7])])
    )
    assert values == [[1.0, 0.0], [0.0, None]]  # Other has no get_reward: None, not 0
    assert seen["prompts"] == [
        [{"role": "user", "content": "Q (shop has 1 items)"}],
        [{"role": "user", "content": "Q"}],
    ]
    assert seen["completions"] == [
        [{"role": "assistant", "content": "A"}],
        [{"role": "assistant", "content": "B"}],
    ]
    assert seen["ids"] == [[5], [6, 7]]
    assert seen["stock"] == [{"a": 1}, {"a": 1}]
    assert [type(e) for e in seen["environments"]] == [Shop, Other]


def test_tools_alone_need_reward_funcs_and_environment_instances_refuse_process_workers():
    def lookup(key: str) -> str:
        """Look a key up."""
        return key

    cfg = AsyncGRPOConfig()
    with pytest.raises(ConfigError, match="no reward source"):
        trl_source(cfg, None, [lookup], None)
    source = trl_source(
        cfg, RewardRunner([lambda completions, **kw: [0.0] * len(completions)]), [lookup], None
    )
    assert source.train_rows is None  # tools alone: the run's dataset
    cfg = AsyncGRPOConfig(**{"rollout.reward_workers": "process"})
    with pytest.raises(ConfigError, match="reward_workers"):
        trl_source(cfg, RewardRunner([len]), None, Shop)


def test_a_recipe_names_the_class_by_its_dotted_path():
    from asyncgrpo.learning.environments import episode_source

    cfg = AsyncGRPOConfig(**{"agent.environment": "test_trl_environments:Shop"})
    source = episode_source(cfg, reward_funcs=None)
    assert source.scorer.names == ["Shop"]  # get_reward alone: rewards may be omitted
    assert source.train_rows == [{"prompt": [{"role": "user", "content": ""}]}] * 4  # TRL's
    cfg = AsyncGRPOConfig(**{"agent.environment": "test_trl_environments:Shopp"})
    with pytest.raises(ConfigError, match="agent.environment: cannot load"):
        episode_source(cfg, reward_funcs=None)


def test_an_async_get_reward_and_an_async_reset_are_awaited():
    class Judged(Shop):
        async def reset(self, **row):
            return " (judged)"

        async def get_reward(self) -> float:
            await asyncio.sleep(0)
            return 0.25

    rollout = TrlRollout([read_environment(None, Judged)], [], 2, {})
    llm = ScriptedLLM([_reply("done")])
    result = run(rollout({"prompt": [{"role": "user", "content": "Q"}]}, llm))
    assert result.stop_reason == StopReason.OK
    assert result.context.reward == 0.25
    assert llm.requests[0]["messages"][-1]["content"] == "Q (judged)"
