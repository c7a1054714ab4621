"""verifiers environments (Prime Intellect's classic API) as episode sources.

A recipe names an environment by `agent.verifiers.id` (+ `args`); it is loaded as
`verifiers.load_environment` loads it (the module named after the id, from installed
packages or the working directory, then its `load_environment(**args)`). Its
`dataset` / `eval_dataset` become the run's rows, each episode runs the environment's
own turn loop (`env.rollout`) with an OpenAI client on the episode's gateway URL, and
once a group has ended its rubric scores the group with its own group call
(`rubric.score_group`), so group-level reward functions see every episode of it.

Decisions, stated:

- Rewards: one column, `rubric`, the rubric's own weighted total (`state["reward"]`,
  what verifiers and prime-rl train on), so custom rubrics and `RubricGroup`s count as
  their author wrote them; each reward function's and metric's value goes to the
  episode's info as `rubric_<name>` (evaluations log `eval_rubric_<name>`).
- The group call sees the episodes that ended `ok`, `max_turns` or `length`; an episode
  that failed (infra_error, a timeout) is not in it, where verifiers' `run_group` would
  score it too.
- Failures: an exception escaping the environment's code (`env_response`,
  `setup_state`, a tool the environment does not catch) and verifiers' `InfraError`
  are the environment's: `EnvironmentFailure`, the episode is `infra_error` and runs
  again. The model's bad output is verifiers' business: it records an empty or
  invalid reply (or a tool error it stops on) in `state["error"]` and its rubric scores
  the rollout, and so do we. An error whose cause is the gateway (unreachable, 5xx,
  an expired episode) is an infra_error. The environment's own stop conditions (its
  `max_turns` included) end the episode `ok`; the gateway's refusal past
  `agent.max_turns` ends it `max_turns`, still scored; verifiers' "maximum context length" handling
  (`prompt_too_long`) and replies cut by `max_tokens` end it `length`, still scored.
- Sampling: the environment's `sampling_args`, then `agent.verifiers.sampling_args`,
  then `rollout.temperature`, `rollout.top_p` and `rollout.max_tokens` (per call), which
  the trainer must agree with.

Where it departs from prime-rl: prime-rl renders prompts itself and sends token ids to
its inference server; here the environment talks plain chat completions and the gateway
records the engine's own tokens of each call, branching when a re-rendered prompt does
not extend the previous one. `verifiers.v1` (0.4) is refused (`refuse_v1`).
"""

from __future__ import annotations

import copy
import importlib
import logging
import signal
import threading
from typing import Any

from asyncgrpo.base.config import ConfigError
from asyncgrpo.learning.environments.source import EpisodeSource

logger = logging.getLogger(__name__)

V1_MISSING = (
    "verifiers.v1 (verifiers >= 0.4) is not supported: it has no offline configuration. "
    "A v1 environment runs its agent as a program that a harness launches in a runtime; "
    "the only local runtime (`subprocess`) takes the `null` and `bash` harnesses, and both "
    "prepare their chat program with `uv sync --script` (UV_OFFLINE forced off), which "
    "installs openai, mcp==2.0.0, httpx, httpx2, tenacity and certifi from the package index "
    "at first run; every other harness needs a container runtime (docker, podman, "
    "apptainer) or Prime's remote sandboxes (the default runtime). Use the classic API: "
    "verifiers < 0.4 (`verifiers.legacy` in 0.3.x, tested with 0.3.1)."
)


def refuse_v1(detail: str = "") -> ConfigError:
    return ConfigError(f"agent.verifiers: {detail}{V1_MISSING}")


def classic_api() -> Any:
    """The classic verifiers package: `verifiers.legacy` (0.3.x) or `verifiers` (< 0.3)."""
    try:
        root = importlib.import_module("verifiers")
    except ImportError as exc:
        if exc.name == "verifiers":
            raise ConfigError(
                "agent.verifiers needs the verifiers package: pip install 'asyncgrpo[verifiers]'"
            ) from exc
        raise ConfigError(f"agent.verifiers: the verifiers package fails to import: {exc}") from exc
    try:
        return importlib.import_module("verifiers.legacy")
    except ImportError:
        pass
    version = getattr(root, "__version__", "?")
    if _older_than_0_4(version) and hasattr(root, "load_environment"):
        return root
    raise refuse_v1(f"verifiers {version} has no classic API. ")


def _older_than_0_4(version: str) -> bool:
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) < (0, 4)


def load_environment(vf: Any, env_id: str, args: dict) -> Any:
    """`vf.load_environment(env_id, **args)`, with clear errors, keeping asyncgrpo's signal
    handlers (a classic Environment installs its own SIGINT/SIGTERM handlers)."""
    module_name = env_id.replace("-", "_").split("/")[-1]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"agent.verifiers.id: cannot import {module_name!r} (install the environment's "
            f"package, or run from the directory that holds it): {exc}"
        ) from exc
    if not hasattr(module, "load_environment"):
        raise refuse_v1(
            f"{module_name!r} has no load_environment() (a classic environment's entry "
            "point); if it is a v1 taskset or environment: "
        )
    saved = _signal_handlers()
    try:
        env = vf.load_environment(env_id, **args)
    except Exception as exc:
        raise ConfigError(f"agent.verifiers: {exc}") from exc
    finally:
        _restore_signal_handlers(saved)
    if not isinstance(env, vf.Environment):
        raise refuse_v1(
            f"{module_name}.load_environment() returned a {type(env).__name__}, not a "
            "classic verifiers Environment. "
        )
    return env


def _signal_handlers() -> dict | None:
    if threading.current_thread() is not threading.main_thread():
        return None
    return {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}


def _restore_signal_handlers(saved: dict | None) -> None:
    for signum, handler in (saved or {}).items():
        if handler is not None:  # None: set outside Python, cannot be put back
            signal.signal(signum, handler)


def sampling_args(cfg: Any, env: Any) -> dict[str, Any]:
    """The chat-call arguments of every turn (see the module docstring)."""
    r, extra = cfg.rollout, dict(cfg.agent.verifiers.sampling_args)
    out = copy.deepcopy(dict(getattr(env, "sampling_args", None) or {}))
    body = {**(out.get("extra_body") or {}), **(extra.pop("extra_body", None) or {})}
    out.update(extra)
    out.pop("n", None)
    out.update(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens)
    if body:
        out["extra_body"] = body
    else:
        out.pop("extra_body", None)
    return out


def verifiers_source(cfg: Any) -> EpisodeSource:
    """The episode source of `cfg.agent.verifiers` (see the module docstring)."""
    section = cfg.agent.verifiers
    vf = classic_api()
    env = load_environment(vf, section.id, dict(section.args))
    _warn_turn_limits(env, cfg.agent.max_turns)
    from asyncgrpo.learning.environments.verifiers_episodes import RubricScorer, VerifiersRollout

    rollout = VerifiersRollout(vf, env, sampling_args(cfg, env))
    train = rows_of(env.get_dataset()) if _has(env, "dataset") else None
    held_out = rows_of(env.get_eval_dataset()) if _has(env, "eval_dataset") else None
    return EpisodeSource(rollout, RubricScorer(env), train_rows=train, eval_rows=held_out)


def _has(env: Any, which: str) -> bool:
    return getattr(env, which, None) is not None or getattr(env, f"{which}_source", None)


def rows_of(dataset: Any) -> list[dict]:
    """A dataset's rows as plain dicts, every column kept (prompt, answer, info, task, ...)."""
    rows = dataset.to_list() if hasattr(dataset, "to_list") else list(dataset)
    return [dict(row) for row in rows]


def _warn_turn_limits(env: Any, max_turns: int) -> None:
    env_turns = getattr(env, "max_turns", None)
    if env_turns is not None and (env_turns <= 0 or env_turns > max_turns):
        logger.warning(
            "the verifiers environment allows %s turns, agent.max_turns %d: the gateway "
            "refuses the call past agent.max_turns (the episode ends max_turns, scored)",
            "unlimited" if env_turns <= 0 else env_turns,
            max_turns,
        )
