"""Running agent episodes: a user's rollout function (or a subprocess) against the episode gateway.

A rollout is `async def rollout(task: dict, llm: LLM) -> float | Result`; it talks
to the model with an ordinary client, `openai.AsyncOpenAI(base_url=llm.base_url,
api_key=llm.api_key)` (or `llm.client()`), as many turns as it likes.
`run_episode` opens an episode on the engine's gateway, runs the rollout under a
timeout, closes the episode with the reward and returns the recorded samples
(`EpisodeOutcome`, an `EpisodeResult`). Subprocess agents get the same endpoint
through `OPENAI_BASE_URL` / `OPENAI_API_KEY` (`run_subprocess_episode`).

How an episode ends (`StopReason`), and why — nothing becomes reward 0 silently:

- the rollout returns a number → `ok` with that reward; `Result(reward,
  stop_reason=...)` lets it say `max_turns`, `length` or `tool_error` itself;
- the gateway refused a call past `max_turns` → `max_turns` (keeping a returned reward);
- the episode timeout → `timeout`, reward None;
- the engine unreachable, a 5xx, a call timeout, an expired or closed episode
  (401/409 from the gateway) → `infra_error`, reward None: not the policy's fault,
  the caller should reschedule the task;
- the prompt outgrew the context (a 400 naming max_model_len, a 413) → `length`, None;
- `RewardError` (raise it, or compute the reward inside `with reward_scope():`),
  a NaN or a missing reward → `reward_error`, reward None: masked, not retried;
- any other exception from the agent's code (a 4xx it caused included) →
  `tool_error`, reward None. An agent bug is deterministic, so rescheduling it would
  loop forever (the retry storms of other stacks); it is counted and logged instead.

Reward None means "do not train on this episode" unless `failure_rewards` maps
the stop reason to an explicit reward (e.g. `{"timeout": 0.0}`); infrastructure
and reward failures can never be given one.

Built in: `tool_loop` (a plain OpenAI-client loop running Python tools through a
`ToolBox`), and the `Environment` protocol (`reset` / `step`) with
`run_environment` and `environment_rollout`. The types a rollout is written against
(`LLM`, `Result`, `RewardError`, `reward_scope`) are in `rollout_api`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import math
import os
import signal
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from asyncgrpo.base.engine_errors import EngineRefused, EngineUnavailable
from asyncgrpo.base.episode import BranchSequence, EpisodeMetrics, EpisodeResult, StopReason
from asyncgrpo.learning.agents.rollout_api import (
    LLM,
    EnvironmentFailure,
    Result,
    RewardError,
    RolloutFn,
)
from asyncgrpo.learning.agents.tools import ToolBox

logger = logging.getLogger(__name__)


@dataclass
class EpisodeOutcome(EpisodeResult):
    """An `EpisodeResult` plus what the runner knows about how it went."""

    episode_id: str = ""
    error: str | None = None  # the exception that ended the episode, if any
    info: dict[str, Any] = field(default_factory=dict)  # Result.info, gateway counters, time
    context: Any = None  # Result.context, for a group scorer
    rewards: list[float | None] | None = None  # a group scorer's values, one per reward name


NEVER_REWARDED = (StopReason.INFRA_ERROR, StopReason.REWARD_ERROR)


class _Ended(NamedTuple):  # how a rollout ended
    reward: float | None
    reason: StopReason
    failures: int = 0
    info: dict = {}  # noqa: RUF012 - read only (`_outcome` builds a new dict)
    error: str | None = None
    context: Any = None


def classify(exc: BaseException) -> StopReason:
    """The stop reason for an exception that escaped a rollout (see the module docstring)."""
    if isinstance(exc, RewardError):
        return StopReason.REWARD_ERROR
    if isinstance(exc, (EngineUnavailable, ConnectionError, EnvironmentFailure)):
        return StopReason.INFRA_ERROR
    if isinstance(exc, EngineRefused):
        return StopReason.INFRA_ERROR
    try:
        import openai
    except ImportError:  # pragma: no cover - openai is a dev dependency
        return StopReason.TOOL_ERROR
    if isinstance(exc, openai.APIConnectionError):  # includes APITimeoutError
        return StopReason.INFRA_ERROR
    if isinstance(exc, openai.APIStatusError):
        status, message = exc.status_code, str(exc)
        if status >= 500 or status in (401, 409):  # engine failure; expired or closed episode
            return StopReason.INFRA_ERROR
        if status == 413 or (status == 400 and "max_model_len" in message):
            return StopReason.LENGTH
        if status == 400 and "max_turns" in message:
            return StopReason.MAX_TURNS
    return StopReason.TOOL_ERROR  # the agent's own bug, or a request it got wrong


def _unpack(value: Any, reward_required: bool = True) -> _Ended:
    """How the rollout ended, from its return value. `reward_required=False`: a group scorer
    gives the reward later, so `ok` without one is not a `reward_error`."""
    if not isinstance(value, Result):
        value = Result(value)
    try:
        reason = StopReason(value.stop_reason)
        reward = None if value.reward is None else float(value.reward)
        failures = int(value.tool_failures)
    except (TypeError, ValueError) as exc:
        return _Ended(None, StopReason.REWARD_ERROR, error=f"rollout returned {value!r}: {exc}")
    if isinstance(value.reward, bool):
        return _Ended(
            None, StopReason.REWARD_ERROR, failures, error="rollout returned a bool reward"
        )
    if reward is not None and math.isnan(reward):
        reward = None
    info = dict(value.info)
    if reward is None and reason == StopReason.OK and reward_required:
        return _Ended(None, StopReason.REWARD_ERROR, failures, info, "no reward returned")
    return _Ended(reward, reason, failures, info, None, value.context)


def _checked_failure_rewards(failure_rewards: Mapping[str, float] | None) -> dict:
    out = {StopReason(k): float(v) for k, v in (failure_rewards or {}).items()}
    for reason in NEVER_REWARDED:
        if reason in out:
            raise ValueError(f"failure_rewards: {reason.value} episodes cannot be given a reward")
    return out


async def run_episode(
    client,
    rollout_fn: RolloutFn,
    task: dict,
    *,
    max_turns: int | None = None,
    episode_timeout_s: float | None = None,
    call_timeout_s: float | None = None,
    failure_rewards: Mapping[str, float] | None = None,
    scored_by_group: bool = False,
) -> EpisodeOutcome:
    """Open an episode on `client`'s engine, run `rollout_fn(task, llm)`, close it, return it.

    `max_turns`: chat calls the gateway accepts (the next is refused with a 400);
    `episode_timeout_s`: the whole rollout; `call_timeout_s`: per call, via
    `llm.client()`; `scored_by_group`: the rollout may return no reward (a group scorer
    gives it). Never raises for a failed episode: see `stop_reason`.
    """
    rewards_for = _checked_failure_rewards(failure_rewards)
    started = time.monotonic()
    try:
        opened = await client.open_episode(max_turns=max_turns)
    except EngineUnavailable as exc:  # a 4xx (no gateway there, bad token) is raised
        return EpisodeOutcome(None, StopReason.INFRA_ERROR, [], error=_describe(exc))
    episode_id = opened["episode_id"]
    llm = LLM(opened["base_url"], opened["api_key"], opened["model"], call_timeout_s)
    ended = await _run_rollout(client, episode_id, rollout_fn, task, llm, episode_timeout_s)
    if ended.reason == StopReason.OK and ended.reward is None and not scored_by_group:
        ended = ended._replace(reason=StopReason.REWARD_ERROR, error="no reward returned")
    try:
        closed = await client.close_episode(
            episode_id, ended.reward, ended.reason.value, ended.failures
        )
    except Exception as exc:
        return EpisodeOutcome(
            None, StopReason.INFRA_ERROR, [], episode_id=episode_id, error=_describe(exc)
        )
    return _outcome(episode_id, ended, closed, rewards_for, started)


async def _run_rollout(
    client, episode_id: str, rollout_fn: RolloutFn, task: dict, llm: LLM, timeout_s: float | None
) -> _Ended:
    """Run the rollout under the episode timeout and say how it ended (`_Ended`).

    A failure becomes its stop reason; a cancellation frees the gateway's
    episode and propagates.
    """
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            value = await rollout_fn(task, llm)
    except TimeoutError as exc:
        if deadline.expired():
            return _Ended(None, StopReason.TIMEOUT, error=f"the episode took over {timeout_s} s")
        return _Ended(None, classify(exc), error=_describe(exc))
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):  # free the gateway's episode, then stop
            await asyncio.shield(client.close_episode(episode_id, None, "infra_error"))
        raise
    except Exception as exc:
        return _Ended(None, classify(exc), error=_describe(exc))
    return _unpack(value, reward_required=False)


def _outcome(
    episode_id: str, ended: _Ended, closed: dict, rewards_for: dict, started: float
) -> EpisodeOutcome:
    """The episode as the rollout ended it and as the gateway recorded it (`closed`)."""
    reward, reason, _, info, error, context = ended
    # the gateway refused a call: whatever the agent made of that, the turns ran out
    if closed.get("refused_turns") and reason in (StopReason.OK, StopReason.TOOL_ERROR):
        reason = StopReason.MAX_TURNS
    if reward is None and reason in rewards_for:
        reward = rewards_for[reason]
    if error:
        logger.warning("episode %s ended with %s: %s", episode_id, reason.value, error)
    info = {
        **info,
        "refused_turns": closed.get("refused_turns", 0),
        "deduped_retries": closed.get("deduped_retries", 0),
        "seconds": time.monotonic() - started,
    }
    return EpisodeOutcome(
        reward,
        reason,
        [BranchSequence(**s) for s in closed["samples"]],
        EpisodeMetrics(**closed["metrics"]),
        episode_id=episode_id,
        error=error,
        info=info,
        context=context,
    )


def training_row(sample: BranchSequence) -> dict[str, list]:
    """A sample in the trainer's prompt/completion form.

    The prompt is everything before the first sampled token; the completion is
    the rest, where `completion_mask` is 0 on the tokens the model did not
    sample (tool results, later user turns, template scaffolding).
    """
    first = sample.loss_mask.index(1) if 1 in sample.loss_mask else len(sample.input_ids)
    return {
        "prompt_ids": sample.input_ids[:first],
        "completion_ids": sample.input_ids[first:],  # (C,)
        "completion_mask": sample.loss_mask[first:],  # (C,)
        "logprobs": sample.logprobs[first:],  # (C,) 0.0 where masked
        "versions": sample.versions[first:],  # (C,) -1 where masked
    }


def _describe(exc: BaseException) -> str:
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-3)
    return "".join(frames).strip()[-2000:]


# ---- agents as subprocesses ----


class AgentProcessError(Exception):
    """The agent process exited with an error (a `tool_error`: the agent's own failure)."""


async def run_agent_process(
    cmd: list[str], task: dict, llm: LLM, *, env: Mapping[str, str] | None = None, cwd=None
) -> Result:
    """Run `cmd` as an agent of this episode and read its reward.

    The process gets `OPENAI_BASE_URL`, `OPENAI_API_KEY`, `OPENAI_MODEL` and the
    task as JSON in `ASYNCGRPO_TASK` and on stdin. Its last non-empty stdout line
    must be a JSON object `{"reward": x}` (optionally with `"stop_reason"` and
    `"tool_failures"`). A non-zero exit is a `tool_error`; a missing or unreadable
    reward line a `reward_error`. Timeouts and cancellation kill its process group.
    """
    task_json = json.dumps(task)
    child_env = {
        **os.environ,
        **(env or {}),
        "OPENAI_BASE_URL": llm.base_url,
        "OPENAI_API_KEY": llm.api_key,
        "OPENAI_MODEL": llm.model,
        "ASYNCGRPO_TASK": task_json,
    }
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=child_env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        stdout, stderr = await proc.communicate(task_json.encode())
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        raise
    if proc.returncode != 0:
        tail = stderr.decode(errors="replace").strip()[-1500:]
        raise AgentProcessError(f"agent {cmd[0]} exited with {proc.returncode}: {tail}")
    return parse_reward_line(stdout.decode(errors="replace"))


def parse_reward_line(stdout: str) -> Result:
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        data = json.loads(lines[-1])
        reward = data["reward"]
        return Result(
            None if reward is None else float(reward),
            data.get("stop_reason", "ok"),
            int(data.get("tool_failures", 0)),
        )
    except (IndexError, ValueError, KeyError, TypeError) as exc:
        last = lines[-1][:200] if lines else "(no output)"
        raise RewardError(f'agent output must end with a {{"reward": x}} line; got {last}') from exc


async def run_subprocess_episode(
    client,
    cmd: list[str],
    task: dict,
    *,
    env: Mapping[str, str] | None = None,
    cwd=None,
    **episode_kwargs: Any,
) -> EpisodeOutcome:
    """`run_episode` with an agent process (`run_agent_process`) as the rollout."""

    async def rollout(task: dict, llm: LLM) -> Result:
        return await run_agent_process(cmd, task, llm, env=env, cwd=cwd)

    return await run_episode(client, rollout, task, **episode_kwargs)


# ---- built-in loops ----


@dataclass
class ToolLoopResult:
    messages: list[dict[str, Any]]  # the whole conversation, replies and tool results included
    final: dict[str, Any]  # the last assistant message
    turns: int
    tool_calls: int
    tool_failures: int
    stop_reason: StopReason  # ok (answered), max_turns, or length (cut by max_tokens)


def _assistant_message(message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [call.model_dump(exclude_none=True) for call in message.tool_calls]
    return out


async def tool_loop(
    llm: LLM,
    messages: list[dict[str, Any]],
    toolbox: ToolBox,
    max_turns: int = 8,
    **create_kwargs: Any,
) -> ToolLoopResult:
    """Ask, run the tool calls of the reply, answer with their results; until a reply without calls.

    A plain OpenAI-client loop (what a user would write): the tools' schemas go in
    `tools`, failures come back to the model as `tool` messages and are counted.
    """
    messages = list(messages)
    calls = failures = 0
    async with llm.client() as oai:
        for turn in range(1, max_turns + 1):
            response = await oai.chat.completions.create(
                model=llm.model, messages=messages, tools=toolbox.schemas, **create_kwargs
            )
            choice = response.choices[0]
            reply = _assistant_message(choice.message)
            messages.append(reply)
            if not choice.message.tool_calls:
                reason = StopReason.LENGTH if choice.finish_reason == "length" else StopReason.OK
                return ToolLoopResult(messages, reply, turn, calls, failures, reason)
            before = sum(toolbox.errors.values())
            messages += await toolbox.respond(choice.message.tool_calls)
            calls += len(choice.message.tool_calls)
            failures += sum(toolbox.errors.values()) - before
    return ToolLoopResult(messages, messages[-1], max_turns, calls, failures, StopReason.MAX_TURNS)


class Environment(Protocol):
    """A text environment the model acts in; methods may be sync or async."""

    def reset(self, task: dict) -> list[dict[str, Any]] | str:
        """The first messages of the episode, or the text of the first user message."""
        ...

    def step(self, action: str) -> tuple[list[dict[str, Any]] | str, float, bool]:
        """(observation, reward of this step, done) after the model replied `action`.

        The observation is the next user message's text, or messages to append.
        """
        ...


async def _maybe_await(value):
    return await value if inspect.isawaitable(value) else value


def _as_messages(observation: list[dict[str, Any]] | str) -> list[dict[str, Any]]:
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    return list(observation)


async def run_environment(
    env: Environment, llm: LLM, task: dict, max_turns: int = 8, **create_kwargs: Any
) -> Result:
    """Drive `env` with the model: reply, step, until done; the reward is the sum of step rewards."""
    messages = _as_messages(await _maybe_await(env.reset(task)))
    total = 0.0
    async with llm.client() as oai:
        for turn in range(1, max_turns + 1):
            response = await oai.chat.completions.create(
                model=llm.model, messages=messages, **create_kwargs
            )
            action = response.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": action})
            observation, reward, done = await _maybe_await(env.step(action))
            total += float(reward)
            if done:
                return Result(total, StopReason.OK, info={"turns": turn})
            messages += _as_messages(observation)
    return Result(total, StopReason.MAX_TURNS, info={"turns": max_turns})


def environment_rollout(
    make_env: Callable[[], Environment], max_turns: int = 8, **create_kwargs: Any
) -> RolloutFn:
    """A rollout function (for `run_episode`) that plays a fresh `make_env()` per episode."""

    async def rollout(task: dict, llm: LLM) -> Result:
        return await run_environment(make_env(), llm, task, max_turns, **create_kwargs)

    return rollout
