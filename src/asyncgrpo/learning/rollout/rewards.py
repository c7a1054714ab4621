"""Reward functions with TRL's signature, resolved by name and run without blocking the loop.

A reward function is `f(prompts, completions, completion_ids, **columns) ->
list[float | None]`, as in TRL: for one group of `n` completions, `prompts` is
the row's prompt repeated `n` times, `completions` the decoded texts,
`completion_ids` the sampled token ids, and every other column of the row comes
as a keyword argument repeated `n` times. As in TRL, a conversational prompt
(a list of messages) gets conversational completions,
`[{"role": "assistant", "content": text}]`; a plain-text prompt gets strings.
A function that takes `trainer_state` (by name, or through `**kwargs`) gets a
`TrainerState` too, with the attribute names of TRL's (`transformers.TrainerState`)
that reward shaping reads: `global_step`, `max_steps`, `epoch`. Functions that take
neither do not get it.

`RewardRunner` resolves each entry of `rewards:` — a Python callable, a
built-in name from `asyncgrpo.learning.tasks`, or a dotted path `package.module:function`
— once, at start-up, so a typo fails before the engine starts (and, with
process workers, so does a function that cannot be pickled). Per group, all
functions run concurrently: `async def` ones are awaited on the rollout loop,
plain ones run in worker threads or worker processes (`reward_workers.py`), so
a slow verifier never stalls generation. Every call has a deadline
(`rollout.reward_timeout_s`): a call that misses it raises `RewardTimeout`
naming the function, counted as `reward_timeout`.

Outputs are checked: one finite number or None per completion; NaN means None
("no opinion", masked by the advantage computation). Anything else — a wrong
length, a string, an exception, a crashed worker — raises `RewardFunctionError` naming
the function, with the original exception chained; the orchestrator counts it
and drops the group (`rollout.reward_error_policy: drop_group`) or stops the run
(`abort`). It is never turned into a reward of 0, which would train the policy on a
failure as if it were a score.
"""

from __future__ import annotations

import asyncio
import difflib
import functools
import importlib
import inspect
import math
import numbers
import pickle
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from asyncgrpo.learning.rollout.reward_workers import (
    CallTimedOut,
    ProcessWorkers,
    RunningCalls,
    ThreadWorkers,
    WorkerCrashed,
    run_on_loop,
)


class RewardFailure(Exception):
    """A group could not be scored; the orchestrator drops it (or stops the run)."""

    reason = "reward_error"  # what the orchestrator counts it as


class RewardFunctionError(RewardFailure):
    """A reward function raised or returned something unusable for a group."""


class RewardTimeout(RewardFailure):
    """A reward function missed `rollout.reward_timeout_s` (or found no free worker in time)."""

    reason = "reward_timeout"


class RewardSpecError(ValueError):
    """A `rewards:` entry that does not name a usable function."""


@dataclass(frozen=True)
class TrainerState:
    """Training progress as reward functions see it (`trainer_state=`), named as in TRL.

    `global_step`: optimizer steps done; `max_steps`: the run's `max_steps`; `epoch`:
    passes over the training prompts so far (fractional, counted at dispatch)."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0


def takes_trainer_state(func: Callable) -> bool:
    """Whether `func` accepts a `trainer_state` keyword (by name or through `**kwargs`)."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # no signature to read (some builtins): do not pass it
        return False
    return any(
        p.kind is p.VAR_KEYWORD or (p.name == "trainer_state" and p.kind is not p.POSITIONAL_ONLY)
        for p in params
    )


# ---- resolution ------------------------------------------------------------------------


def resolve_reward(entry: Any) -> Callable:
    """A callable for a `rewards:` entry: callable, built-in name, or `pkg.module:function`."""
    if callable(entry):
        return entry
    if not isinstance(entry, str) or not entry.strip():
        raise RewardSpecError(f"reward function entry {entry!r} is neither a callable nor a name")
    from asyncgrpo.learning.tasks import REWARDS

    name = entry.strip()
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name or "." in name:
        return _import_path(name)
    close = difflib.get_close_matches(name, list(REWARDS), n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"built-in: {', '.join(sorted(REWARDS))}"
    raise RewardSpecError(
        f"unknown reward function '{name}'; {hint} "
        "(or give a dotted path 'package.module:function')"
    )


def _import_path(path: str) -> Callable:
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise RewardSpecError(f"reward function '{path}': expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise RewardSpecError(
            f"reward function '{path}': cannot import module '{module_name}' "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            names = [n for n in dir(target) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise RewardSpecError(
                f"reward function '{path}': '{module_name}' has no attribute '{part}'{hint}"
            )
        target = getattr(target, part)
    if not callable(target):
        raise RewardSpecError(
            f"reward function '{path}' is a {type(target).__name__}, not callable"
        )
    return target


def reward_name(func: Callable) -> str:
    """The name metrics use (`reward/<name>`): `__name__`, or the class of a callable object."""
    inner = func.func if isinstance(func, functools.partial) else func
    return getattr(inner, "__name__", None) or type(inner).__name__


def _is_async(func: Callable) -> bool:
    inner = func.func if isinstance(func, functools.partial) else func
    return inspect.iscoroutinefunction(inner) or inspect.iscoroutinefunction(
        getattr(inner, "__call__", None)  # noqa: B004 - an object whose __call__ is async
    )


# ---- running ---------------------------------------------------------------------------


class RewardRunner:
    """Scores groups with a fixed list of reward functions (see the module docstring).

    `workers` is where plain functions run, `thread` or `process`, at most `num_workers`
    calls at once; `timeout_s` is the deadline of one call.
    """

    def __init__(
        self,
        funcs: Sequence[Any],
        *,
        timeout_s: float = 60.0,
        workers: str = "thread",
        num_workers: int = 4,
    ):
        if isinstance(funcs, str | bytes) or callable(funcs):
            funcs = [funcs]
        self.funcs = [resolve_reward(f) for f in funcs]
        if not self.funcs:
            raise RewardSpecError("no reward functions given")
        self.names: list[str] = []
        seen: Counter[str] = Counter()
        for f in self.funcs:  # unique names, so two functions never write the same metric
            name = reward_name(f)
            seen[name] += 1
            self.names.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
        self.timeout_s = timeout_s
        self.takes_state = [takes_trainer_state(f) for f in self.funcs]
        self.trainer_state = TrainerState()  # replaced (never changed) by the run as it trains
        self.running = RunningCalls()  # what the watchdog reports
        plain = [None if _is_async(f) else f for f in self.funcs]
        if workers == "process":
            _check_picklable(plain, self.names)
            self._workers = ProcessWorkers(plain, self.names, num_workers, self.running)
        elif workers == "thread":
            self._workers = ThreadWorkers(plain, self.names, num_workers, self.running)
        else:
            raise RewardSpecError(f"reward workers {workers!r}: expected 'thread' or 'process'")

    async def score_group(
        self,
        row: dict,
        texts: list[str],
        completion_ids: list[list[int]],
        *,
        prompts: list | None = None,
        completions: list | None = None,
        extra: dict[str, list] | None = None,
    ) -> list[list[float | None]]:
        """One list per reward function, each with a float or None per completion.

        Episode sources pass what TRL would: `prompts` (one per completion, e.g. with an
        environment's `reset` text appended), `completions` (whole conversations of
        assistant and tool messages) and `extra` keyword lists (`environments=`); by
        default the row's prompt and the texts as single replies."""
        n = len(texts)
        prompt = row.get("prompt", "")
        if completions is None:
            conversational = isinstance(prompt, list)
            completions = (
                [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
            )
        columns = {k: [v] * n for k, v in row.items() if k != "prompt"}
        kwargs = dict(
            prompts=prompts if prompts is not None else [prompt] * n,
            completions=completions,
            completion_ids=completion_ids,
            **columns,
            **(extra or {}),
        )
        results = await asyncio.gather(
            *[self._call(i, kwargs) for i in range(len(self.funcs))], return_exceptions=True
        )
        out = []
        for name, result in zip(self.names, results, strict=True):
            if isinstance(result, asyncio.CancelledError | RewardFailure):
                raise result
            if isinstance(result, BaseException):
                raise RewardFunctionError(
                    f"reward function '{name}' raised {type(result).__name__}: {result}"
                ) from result
            out.append(check_scores(name, result, n))
        return out

    async def _call(self, index: int, kwargs: dict) -> Any:
        name, func = self.names[index], self.funcs[index]
        if self.takes_state[index]:
            kwargs = {**kwargs, "trainer_state": self.trainer_state}
        try:
            if _is_async(func):
                return await run_on_loop(name, func(**kwargs), self.timeout_s, self.running)
            result = await self._workers.run(index, kwargs, self.timeout_s)
            if inspect.isawaitable(result):  # a plain function that returned a coroutine
                result = await run_on_loop(name, result, self.timeout_s, self.running)
            return result
        except CallTimedOut as exc:
            raise RewardTimeout(
                f"reward function '{name}' {exc} (rollout.reward_timeout_s)"
            ) from None
        except WorkerCrashed as exc:
            raise RewardFunctionError(f"reward function '{name}' crashed: {exc}") from None

    def close(self) -> None:
        """Stop the workers without waiting for a stuck call (the process must be able to exit)."""
        self._workers.close()


def _check_picklable(funcs: list[Callable | None], names: list[str]) -> None:
    """Process workers import the functions by reference: refuse, at start-up, those they
    could not (lambdas, local functions, anything defined in the main script)."""
    for func, name in zip(funcs, names, strict=True):
        if func is None:
            continue
        inner = func.func if isinstance(func, functools.partial) else func
        try:
            pickle.dumps(func)
            problem = (
                "it is defined in the main script"
                if getattr(inner, "__module__", None) == "__main__"
                else ""
            )
        except Exception as exc:
            problem = f"it cannot be pickled ({exc})"
        if problem:
            raise RewardSpecError(
                f"reward function '{name}' cannot run in a worker process "
                f"(rollout.reward_workers: process): {problem}; define it at module level "
                "in an importable module, or use reward_workers: thread"
            )


def check_scores(name: str, result: Any, n: int) -> list[float | None]:
    """`result` as n floats-or-None; NaN becomes None; anything else is a RewardFunctionError."""
    if hasattr(result, "tolist") and not isinstance(result, list):
        result = result.tolist()  # numpy array or tensor
    if isinstance(result, str | bytes | dict) or not isinstance(result, Sequence):
        raise RewardFunctionError(
            f"reward function '{name}' returned {type(result).__name__}; "
            f"expected a list of {n} numbers (one per completion)"
        )
    if len(result) != n:
        raise RewardFunctionError(
            f"reward function '{name}' returned {len(result)} scores for {n} completions"
        )
    scores: list[float | None] = []
    for i, value in enumerate(result):
        if value is None:
            scores.append(None)
            continue
        if not isinstance(value, numbers.Real):
            raise RewardFunctionError(
                f"reward function '{name}' returned {value!r} for completion {i}; "
                "expected a number or None"
            )
        value = float(value)
        if math.isnan(value):
            scores.append(None)
        elif math.isinf(value):
            raise RewardFunctionError(
                f"reward function '{name}' returned {value} for completion {i}"
            )
        else:
            scores.append(value)
    return scores
