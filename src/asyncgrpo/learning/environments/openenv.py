"""OpenEnv environment servers as episode sources: one WebSocket session per episode.

`agent.openenv` names a running server (`url`) or an app (`module:app`) that asyncgrpo
serves for the run (`openenv_server.ServedApp`). At start the adapter reads `/schema`:
the action's JSON schema becomes ONE tool, named after the action class (`GuessAction`
→ `guess`; `step` for a bare `Action`), whose parameters are the action's fields (the
base class's `metadata` left out). It then opens `rollout.num_generations` sessions at
once: a group plays that many episodes concurrently, each on its own session, and a
server that allows fewer (OpenEnv's default is one) is refused with what to change.

An episode (`play`), driven with OpenEnv's own async `GenericEnvClient`:

- `reset(**row)`: every column of the row but `prompt` goes to `reset`, which keeps
  those it accepts (OpenEnv filters them by its signature), as TRL's
  `environment_factory` calls `reset(**row)`. Without a `dataset:` the rows are
  `{"seed": i}`, so a group's episodes play the same task. The conversation opens with
  `agent.openenv.prompt` (shared: a system prompt, a worked example), then the row's
  `prompt`; the first observation is appended to the last user message, or becomes a
  user message of its own.
- each tool call of a reply is one `step(action)`; the observation comes back as the
  tool message (carrying no loss, as every tool message); rewards are summed until an
  observation says `done` (stop reason ok) or `agent.max_turns` chat calls pass
  (max_turns, with the sum so far). A reply without a tool call ends the episode as ok
  with the sum so far, as TRL's tool loop and `tool_loop` end at a reply without calls:
  the model chose to stop acting.
- an action that is not valid (bad JSON, an unknown tool, arguments the schema or the
  server's validation refuses) comes back as an error tool message and counts as a
  tool failure; the session stays open and the model may try again.
- a server error, a dropped connection, no answer within `message_timeout_s`: the
  episode raises `EnvironmentFailure` (infra_error: run again, never scored 0). The
  session is closed however the episode ends.

Observations are shown as text: the one string field of an observation alone, else its
fields (less `metadata`) as JSON. `Result.info` carries `env_steps` and `env_done`
(whether the environment finished the episode), averaged in evaluations.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import re
from typing import Any

import httpx

from asyncgrpo.base.config import ConfigError, RunConfig
from asyncgrpo.base.config.environments import OpenEnvConfig
from asyncgrpo.base.episode import StopReason
from asyncgrpo.learning.agents.rollout_api import LLM, EnvironmentFailure, Result, RewardError
from asyncgrpo.learning.environments.source import EpisodeSource

logger = logging.getLogger(__name__)

_ERROR_CODE = re.compile(r"\(code: ([A-Za-z_.]+)\)\s*$")
_CAPACITY = re.compile(r"(\d+)/(\d+) sessions active")


# ---- the action as a tool, observations as text ----


def action_tool(action_schema: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI `tools` entry for an OpenEnv action's JSON schema."""
    parameters = {k: v for k, v in action_schema.items() if k not in ("title", "description")}
    properties = {
        name: {k: v for k, v in prop.items() if k != "title"}
        for name, prop in action_schema.get("properties", {}).items()
        if name != "metadata"  # the base Action's free-form field, not the model's to fill
    }
    parameters["properties"] = properties
    parameters["required"] = [r for r in action_schema.get("required", []) if r in properties]
    parameters.setdefault("type", "object")
    title = str(action_schema.get("title") or "")
    stem = re.sub(r"Action$", "", title)
    name = re.sub(r"(?<!^)(?=[A-Z])", "_", stem).lower() if stem.isidentifier() else ""
    description = action_schema.get("description") or f"Act in the environment ({title})."
    return {
        "type": "function",
        "function": {"name": name or "step", "description": description, "parameters": parameters},
    }


def render_observation(observation: dict[str, Any]) -> str:
    """An observation's text: its one string field, else its fields as JSON."""
    fields = {k: v for k, v in observation.items() if k != "metadata"}
    if len(fields) == 1 and isinstance(next(iter(fields.values())), str):
        return next(iter(fields.values()))
    return json.dumps(fields, ensure_ascii=False, default=str)


def _as_messages(prompt: str | list[dict] | None) -> list[dict]:
    if prompt is None:
        return []
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def opening_messages(row: dict, preamble: Any, first_observation: str) -> list[dict]:
    """`agent.openenv.prompt`, then the row's prompt, then the first observation: appended to
    the last user message, or a user message of its own."""
    messages = _as_messages(preamble) + _as_messages(row.get("prompt"))
    last = messages[-1] if messages else {}
    if last.get("role") == "user" and isinstance(last.get("content"), str):
        messages[-1] = {**last, "content": f"{last['content']}\n\n{first_observation}"}
    else:
        messages.append({"role": "user", "content": first_observation})
    return messages


# ---- one session ----


class ActionRejected(Exception):
    """The server refused an action (its validation): the model's mistake, not the server's."""


class EnvSession:
    """One WebSocket session (`GenericEnvClient`) with failures sorted: a refused action is
    `ActionRejected`, anything else the server or the connection does `EnvironmentFailure`."""

    def __init__(self, url: str, timeout_s: float):
        from openenv.core import GenericEnvClient

        self.timeout_s = timeout_s
        self.client = GenericEnvClient(
            base_url=url, connect_timeout_s=timeout_s, message_timeout_s=timeout_s
        )

    async def __aenter__(self) -> EnvSession:
        await self._call("connect", lambda: self.client.connect())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        with contextlib.suppress(Exception):
            await asyncio.shield(self.client.close())

    async def reset(self, **kwargs: Any):
        return await self._call("reset", lambda: self.client.reset(**kwargs))

    async def step(self, action: dict[str, Any]):
        return await self._call("step", lambda: self.client.step(action))

    async def _call(self, what: str, request):
        try:
            return await request()
        except TimeoutError as exc:
            raise EnvironmentFailure(
                f"OpenEnv {what}: no answer within {self.timeout_s:g} s "
                "(agent.openenv.message_timeout_s)"
            ) from exc
        except Exception as exc:
            code = error_code(exc)
            if what == "step" and code == "VALIDATION_ERROR":
                raise ActionRejected(str(exc)) from exc
            raise EnvironmentFailure(f"OpenEnv {what} failed: {type(exc).__name__}: {exc}") from exc


def error_code(exc: BaseException) -> str | None:
    """The server's error code (`VALIDATION_ERROR`, ...) in an `EnvClient` error, if any."""
    found = _ERROR_CODE.search(str(exc)) if isinstance(exc, RuntimeError) else None
    return found.group(1) if found else None


# ---- an episode ----


class ActionChecker:
    """Decodes a tool call into the action dict, or says (as the model will read it) why not."""

    def __init__(self, tool: dict[str, Any]):
        import jsonschema

        self.name = tool["function"]["name"]
        self.validator = jsonschema.Draft202012Validator(tool["function"]["parameters"])

    def action(self, call: Any) -> tuple[dict[str, Any] | None, str | None]:
        if call.function.name != self.name:
            return None, f"Error: unknown tool {call.function.name!r}; the tool is {self.name!r}."
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except ValueError as exc:
            return None, f"Error: the arguments are not valid JSON ({exc})."
        if not isinstance(arguments, dict):
            return None, "Error: the arguments must be a JSON object."
        problems = sorted(self.validator.iter_errors(arguments), key=lambda e: list(e.path))
        if problems:
            where = ".".join(str(p) for p in problems[0].path) or "arguments"
            return None, f"Error: invalid action: {where}: {problems[0].message}."
        return arguments, None


def _assistant(message: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [c.model_dump(exclude_none=True) for c in message.tool_calls]
    return out


class EpisodeTally:
    """Reward, steps and failures of one episode so far."""

    def __init__(self):
        self.reward, self.steps, self.failures, self.done = 0.0, 0, 0, False

    def result(self, stop: StopReason) -> Result:
        info = {"env_steps": self.steps, "env_done": self.done}
        return Result(self.reward, stop, tool_failures=self.failures, info=info)


async def act(env: EnvSession, checker: ActionChecker, call: Any, tally: EpisodeTally) -> str:
    """Run one tool call as a step; the tool message's text."""
    action, problem = checker.action(call)
    if action is None:
        tally.failures += 1
        return problem or "Error"
    try:
        result = await env.step(action)
    except ActionRejected as exc:
        tally.failures += 1
        return f"Error: the environment refused the action: {exc}"
    tally.steps += 1
    if isinstance(result.reward, int | float) and not isinstance(result.reward, bool):
        tally.reward += float(result.reward)
    tally.done = bool(result.done)
    return render_observation(result.observation or {})


def episode_rollout(
    url: str, tool: dict[str, Any], openenv_cfg: OpenEnvConfig, max_turns: int, **sampling: Any
):
    """The rollout function: one session per episode (see the module docstring); `sampling`
    goes to every chat call (temperature, top_p, max_tokens)."""
    checker = ActionChecker(tool)

    async def play(row: dict, llm: LLM) -> Result:
        tally = EpisodeTally()
        async with EnvSession(url, openenv_cfg.message_timeout_s) as env:
            first = await env.reset(**{k: v for k, v in row.items() if k != "prompt"})
            if first.done:
                raise RewardError("the environment ended the episode at reset")
            opening = render_observation(first.observation or {})
            messages = opening_messages(row, openenv_cfg.prompt, opening)
            async with llm.client() as oai:
                for _ in range(max_turns):
                    response = await oai.chat.completions.create(
                        model=llm.model, messages=messages, tools=[tool], **sampling
                    )
                    choice = response.choices[0]
                    messages.append(_assistant(choice.message))
                    if not choice.message.tool_calls:
                        cut = choice.finish_reason == "length"
                        return tally.result(StopReason.LENGTH if cut else StopReason.OK)
                    for call in choice.message.tool_calls:
                        text = await act(env, checker, call, tally)
                        messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
                        if tally.done:
                            return tally.result(StopReason.OK)
        return tally.result(StopReason.MAX_TURNS)

    return play


# ---- at start: the schema and the server's concurrency ----


def read_schema(url: str, timeout_s: float) -> dict[str, Any]:
    try:
        response = httpx.get(f"{url}/schema", timeout=timeout_s)
        response.raise_for_status()
        schema = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise ConfigError(
            f"agent.openenv: cannot read {url}/schema ({type(exc).__name__}: {exc}); "
            "is an OpenEnv server running there?"
        ) from None
    if not isinstance(schema, dict) or not isinstance(schema.get("action"), dict):
        raise ConfigError(f"agent.openenv: {url}/schema has no action schema: {schema!r:.300}")
    return schema


async def _probe_sessions(url: str, count: int, timeout_s: float) -> list[BaseException | None]:
    """Open `count` sessions at once (each asks for its state), then close them all."""
    sessions = [EnvSession(url, timeout_s) for _ in range(count)]

    async def one(session: EnvSession) -> None:
        await session.__aenter__()
        await session._call("state", lambda: session.client.state())

    try:
        outcomes = await asyncio.gather(*(one(s) for s in sessions), return_exceptions=True)
    finally:
        await asyncio.gather(*(s.__aexit__() for s in sessions), return_exceptions=True)
    return [o if isinstance(o, BaseException) else None for o in outcomes]


def check_concurrency(url: str, needed: int, timeout_s: float) -> None:
    """Refuse a server that cannot hold a group's sessions at once; warn if unknown."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # works under a running loop too
        errors = pool.submit(asyncio.run, _probe_sessions(url, needed, timeout_s)).result()
    failed = [e for e in errors if e is not None]
    if not failed:
        logger.info("OpenEnv server %s holds %d sessions at once", url, needed)
        return
    capacity = [m for e in failed if (m := _CAPACITY.search(str(e.__cause__ or e)))]
    if capacity:
        allowed = int(capacity[0].group(2))
        if allowed < needed:
            raise ConfigError(
                f"agent.openenv: the server at {url} allows {allowed} concurrent session(s) "
                f"(max_concurrent_envs={allowed}), but a group of rollout.num_generations="
                f"{needed} episodes plays {needed} sessions at once. Serve the environment "
                f"with create_app(..., max_concurrent_envs={needed} or more) and "
                "SUPPORTS_CONCURRENT_SESSIONS = True on its Environment class (OpenEnv "
                "refuses more than one session otherwise), or lower rollout.num_generations."
            )
        logger.warning(
            "agent.openenv: the server at %s allows %d sessions but only %d of %d opened now "
            "(others are in use); episodes will wait for free sessions",
            url, allowed, needed - len(capacity), needed,
        )  # fmt: skip
        return
    logger.warning(
        "agent.openenv: could not check how many sessions %s holds at once (%s); a group "
        "needs %d (rollout.num_generations)",
        url, failed[0], needed,
    )  # fmt: skip


def seed_rows(openenv_cfg: OpenEnvConfig) -> tuple[list[dict], list[dict] | None]:
    train = [{"seed": i} for i in range(openenv_cfg.seeds)]
    held = range(openenv_cfg.seeds, openenv_cfg.seeds + openenv_cfg.eval_seeds)
    return train, [{"seed": i} for i in held] or None


def openenv_source(cfg: RunConfig) -> EpisodeSource:
    """The run's episodes against the OpenEnv server of `agent.openenv`."""
    from asyncgrpo.learning.environments.openenv_server import ServedApp

    openenv_cfg: OpenEnvConfig = cfg.agent.openenv  # type: ignore[assignment]
    served = None
    if openenv_cfg.app is not None:
        served = ServedApp(openenv_cfg.app, openenv_cfg.startup_timeout_s)
    url = (served.url if served else str(openenv_cfg.url)).rstrip("/")
    try:
        schema = read_schema(url, openenv_cfg.message_timeout_s)
        tool = action_tool(schema["action"])
        check_concurrency(url, cfg.rollout.num_generations, openenv_cfg.message_timeout_s)
    except BaseException:
        if served is not None:
            served.stop()
        raise
    logger.info("OpenEnv action tool: %s", json.dumps(tool["function"]))
    train, held_out = seed_rows(openenv_cfg)
    return EpisodeSource(
        rollout=episode_rollout(
            url,
            tool,
            openenv_cfg,
            cfg.agent.max_turns,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            max_tokens=cfg.rollout.max_tokens,
        ),
        train_rows=train,
        eval_rows=held_out,
        closers=[served.stop] if served is not None else [],
    )
