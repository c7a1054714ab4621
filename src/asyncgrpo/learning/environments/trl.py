"""TRL's `tools=` and `environment_factory=` as an episode source, with TRL 1.16's semantics.

Per episode (TRL: per rollout): a fresh `Cls()`; `reset(**row)` (without the
`environment` column when the factory is a `{name: Cls}` mapping), whose text, if any,
is appended to the last user message; then the tool loop through the episode's
gateway: the model's reply, its tool calls run one after another against this
instance's methods (and the `tools=` functions), their results sent back as `tool`
messages, until a reply without a call or `agent.max_turns` calls (TRL's
`max_tool_calling_iterations` + 1; as in TRL, the calls of the last reply are then not
run). `get_reward()`, when the class has one, is called as the episode ends.

The group is scored together, as TRL scores a batch (`TrlScorer`): the run's reward
functions get TRL's keywords, `prompts` (with the reset text), `completions` (the
episode's assistant and tool messages, tool calls with their arguments as dicts, as
TRL's parser gives them), `completion_ids` (every token after the prompt, tool tokens
included), the row's columns and `environments` (the instances); each class with
`get_reward` adds a column named after it (weight 1), None for episodes of another class.

Failures: the constructor, `reset` or `get_reward` raising is the environment's failure,
not the policy's: `EnvironmentFailure`, the episode is an infra_error and runs again
(`agent.max_infra_retries`). A tool raising is information for the model (an error
message in its `tool` message, counted as a tool failure), as in TRL.

Departures from TRL, stated: TRL builds a pool of instances and resets them batch after
batch; asyncgrpo builds one per episode (episodes of several steps overlap, so an
instance is never shared between two of them). Tool arguments are checked against the
type hints before the call (a wrong type is an error message, not a call); a
non-string tool result is sent as JSON (TRL: `str(result)`). `max_completion_length`
(`rollout.max_tokens`) bounds each reply, not the whole episode (`engine.max_model_len`
does that).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncgrpo.base.config import ConfigError
from asyncgrpo.base.episode import StopReason
from asyncgrpo.learning.agents.rollout_api import LLM, EnvironmentFailure, Result
from asyncgrpo.learning.agents.runner import EpisodeOutcome, training_row
from asyncgrpo.learning.agents.tools import ToolBox
from asyncgrpo.learning.environments.source import EpisodeSource
from asyncgrpo.learning.environments.trl_classes import (
    EnvironmentKind,
    check_tools,
    load_class,
    read_environments,
)
from asyncgrpo.learning.rollout.rewards import check_scores

logger = logging.getLogger(__name__)

EMPTY_PROMPT = [{"role": "user", "content": ""}]  # TRL's prompt for a row without one


@dataclass
class TrlEpisode:
    """What an episode leaves for the scorer (`Result.context`)."""

    environment: Any  # the instance (None with `tools=` alone)
    kind: EnvironmentKind | None
    prompt: Any  # as the reward functions see it: the row's, with the reset text
    completion: list[dict[str, Any]] = field(default_factory=list)  # TRL-shaped messages
    reward: Any = None  # what get_reward() returned


def trl_source(cfg: Any, reward_funcs: Any, tools: Any, environment_factory: Any) -> EpisodeSource:
    """The episode source of `tools=` / `environment_factory=` (or `agent.environment`)."""
    if environment_factory is None and cfg.agent.environment:
        environment_factory = load_class(cfg.agent.environment)
    kinds = read_environments(environment_factory) if environment_factory is not None else []
    standalone = check_tools(tools)
    reward_classes = _reward_classes(kinds)
    if reward_funcs is None and not reward_classes:
        raise ConfigError(
            "no reward source: pass reward_funcs (recipe `rewards:`), or an environment class "
            "with a get_reward() method"
        )
    if kinds and reward_funcs is not None and cfg.rollout.reward_workers == "process":
        raise ConfigError(
            "rollout.reward_workers: process cannot hand environment instances to reward "
            "functions (environments=); use reward_workers: thread"
        )
    _extend_reward_weights(cfg, reward_funcs, reward_classes)
    rollout = TrlRollout(kinds, standalone, cfg.agent.max_turns, _sampling(cfg))
    scorer = TrlScorer(reward_funcs, reward_classes)
    single = len(kinds) == 1 and kinds[0].name is None
    train_rows = [{"prompt": list(EMPTY_PROMPT)}] * cfg.coordinator.batch_groups if single else None
    return EpisodeSource(rollout, scorer, train_rows=train_rows, scores_with_rewards=True)


def _reward_classes(kinds: list[EnvironmentKind]) -> list[type]:
    """The classes with `get_reward`, each once (two names may map to one class)."""
    out: list[type] = []
    for kind in kinds:
        if kind.has_reward and kind.cls not in out:
            out.append(kind.cls)
    return out


def _extend_reward_weights(cfg: Any, reward_funcs: Any, reward_classes: list[type]) -> None:
    """TRL's `reward_weights` weigh `reward_funcs`; each get_reward column adds weight 1."""
    weights = cfg.advantage.reward_weights
    funcs = len(reward_funcs.names) if reward_funcs is not None else 0
    if weights is not None and reward_classes and len(weights) == funcs:
        cfg.advantage.reward_weights = [*weights, *[1.0] * len(reward_classes)]


def _sampling(cfg: Any) -> dict[str, Any]:
    r = cfg.rollout
    return {"max_tokens": r.max_tokens, "temperature": r.temperature, "top_p": r.top_p}


class TrlRollout:
    """The rollout function of the source: `await rollout(row, llm)` (module docstring)."""

    def __init__(
        self,
        kinds: list[EnvironmentKind],
        tools: list[Callable],
        max_turns: int,
        sampling: dict[str, Any],
    ):
        self.kinds = {kind.name: kind for kind in kinds}
        self.tools = tools
        self.max_turns = max_turns
        self.sampling = sampling

    def kind_of(self, row: dict) -> EnvironmentKind | None:
        if not self.kinds:
            return None
        if None in self.kinds:
            return self.kinds[None]
        name = row.get("environment")
        if name not in self.kinds:
            raise ConfigError(  # a data mistake: a tool_error, counted, never rescheduled
                f"row has environment={name!r}, not one of the environment_factory names "
                f"{list(self.kinds)}"
            )
        return self.kinds[name]

    async def __call__(self, row: dict, llm: LLM) -> Result:
        kind = self.kind_of(row)
        environment = observation = None
        if kind is not None:
            environment = await _environment_call(f"{kind.cls.__name__}()", kind.factory)
            reset_row = (
                row if kind.name is None else {k: v for k, v in row.items() if k != "environment"}
            )
            observation = await _environment_call("reset", environment.reset, **reset_row)
        prompt = with_observation(row.get("prompt", EMPTY_PROMPT), observation)
        episode = TrlEpisode(environment, kind, prompt)
        methods = [getattr(environment, name) for name in kind.tool_names] if kind else []
        toolbox = ToolBox([*self.tools, *methods], timeout=3600.0)
        stop = await self.play(llm, as_messages(prompt), toolbox, episode)
        if kind is not None and kind.has_reward:
            episode.reward = await _environment_call("get_reward", environment.get_reward)
        info = {"tool_calls": toolbox.calls}
        return Result(None, stop, sum(toolbox.errors.values()), info, context=episode)

    async def play(
        self, llm: LLM, messages: list[dict], toolbox: ToolBox, episode: TrlEpisode
    ) -> StopReason:
        """The tool loop; appends TRL-shaped messages to `episode.completion`."""
        tools = {"tools": toolbox.schemas} if toolbox.tools else {}
        async with llm.client() as oai:
            for turn in range(1, self.max_turns + 1):
                response = await oai.chat.completions.create(
                    model=llm.model, messages=messages, **tools, **self.sampling
                )
                choice = response.choices[0]
                calls = choice.message.tool_calls or []
                messages.append(_sent_back(choice.message))
                episode.completion.append(trl_assistant_message(choice.message))
                if not calls:
                    return StopReason.LENGTH if choice.finish_reason == "length" else StopReason.OK
                if turn == self.max_turns:  # TRL leaves the last reply's calls unrun
                    break
                for call in calls:  # one after another: they share the instance's state
                    result = await toolbox.run(call)
                    messages.append(
                        {"role": "tool", "tool_call_id": call.id, "content": result.content}
                    )
                    episode.completion.append(
                        {"role": "tool", "name": call.function.name, "content": result.content}
                    )
        return StopReason.MAX_TURNS


async def _environment_call(what: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call an environment's constructor or method (sync ones in a thread, so a slow one
    does not stall the other episodes); any exception is an `EnvironmentFailure`."""
    try:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        value = await asyncio.to_thread(fn, *args, **kwargs)
        return await value if inspect.isawaitable(value) else value
    except Exception as exc:
        raise EnvironmentFailure(
            f"the environment's {what} raised {type(exc).__name__}: {exc}"
        ) from exc


def with_observation(prompt: Any, observation: Any) -> Any:
    """TRL's rule: a string from `reset` is appended to the last message's content (a new
    list; the row is not changed). A plain-text prompt gets it appended to its text."""
    if observation is None:
        return prompt
    if not isinstance(observation, str):
        raise EnvironmentFailure(f"reset() returned {type(observation).__name__}, not str or None")
    if isinstance(prompt, str):
        return prompt + observation
    last = prompt[-1]
    content = last.get("content") or ""
    if isinstance(content, list):  # content parts: the text joins as one more part
        content = [*content, {"type": "text", "text": observation}]
    else:
        content = content + observation
    return [*prompt[:-1], {**last, "content": content}]


def as_messages(prompt: Any) -> list[dict[str, Any]]:
    """The chat the model is sent: a plain-text prompt is one user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def _sent_back(message: Any) -> dict[str, Any]:
    """The reply as the next request repeats it (the gateway continues the same tokens)."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [call.model_dump(exclude_none=True) for call in message.tool_calls]
    return out


def trl_assistant_message(message: Any) -> dict[str, Any]:
    """The reply as TRL's response parser gives it to reward functions: tool calls as
    `{"type": "function", "function": {"name", "arguments": dict}}`."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "type": "function",
                "function": {
                    "name": c.function.name,
                    "arguments": _arguments(c.function.arguments),
                },
            }
            for c in message.tool_calls
        ]
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return text


class TrlScorer:
    """Scores a group as TRL scores a batch (see the module docstring); a `GroupScorer`."""

    def __init__(self, reward_funcs: Any, reward_classes: list[type]):
        self.funcs = reward_funcs  # the run's RewardRunner, or None
        self.reward_classes = reward_classes
        names = list(reward_funcs.names) if reward_funcs is not None else []
        for cls in reward_classes:
            name, n = cls.__name__, 1
            while name in names:
                n += 1
                name = f"{cls.__name__}_{n}"
            names.append(name)
        self.names = names

    async def score(self, row: dict, outcomes: list[EpisodeOutcome]) -> list[list[float | None]]:
        episodes: list[TrlEpisode] = [o.context for o in outcomes]
        columns: list[list[float | None]] = []
        if self.funcs is not None:
            conversational = not isinstance(episodes[0].prompt, str)
            completions = [
                e.completion if conversational else _final_text(e.completion) for e in episodes
            ]
            ids = [training_row(o.samples[-1])["completion_ids"] for o in outcomes]
            extra = {}
            if any(e.kind is not None for e in episodes):
                extra["environments"] = [e.environment for e in episodes]
            columns += await self.funcs.score_group(
                row,
                [_final_text(e.completion) for e in episodes],
                ids,
                prompts=[e.prompt for e in episodes],
                completions=completions,
                extra=extra,
            )
        for cls, name in zip(self.reward_classes, self.names[len(columns) :], strict=True):
            values = [e.reward if type(e.environment) is cls else None for e in episodes]
            columns.append(check_scores(name, values, len(episodes)))
        return [list(values) for values in zip(*columns, strict=True)]


def _final_text(completion: list[dict[str, Any]]) -> str:
    replies = [m for m in completion if m["role"] == "assistant"]
    return replies[-1]["content"] if replies else ""
