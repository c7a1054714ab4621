"""verifiers environments as episode sources: whichever verifiers is installed decides how.

verifiers 0.4 has only its new API (a package exporting a `Taskset`, run as a verifiers
`Env`): `verifiers_v1` loads it, `verifiers_v1_episodes` and `verifiers_v1_host` run it.
verifiers 0.3.x keeps the classic API in `verifiers.legacy`, and so does this module: the
classic path below keeps training classic environments wherever 0.3.x is installed. The
two cannot share a Python environment (0.4 pins mcp 2.0, 0.3.1 and openenv need mcp < 2),
so the installed version is the switch, and an environment of the other API is refused
with the version it needs. `asyncgrpo[verifiers]` installs 0.4.0; `asyncgrpo[dev]` keeps
0.3.1 (beside openenv) for the classic tests.

The classic path. A recipe names an environment by `agent.verifiers.id` (+ `args`); it is
loaded as `verifiers.load_environment` loads it (the module named after the id, from
installed packages or the working directory, then its `load_environment(**args)`). Its
`dataset` / `eval_dataset` become the run's rows, each episode runs the environment's
own turn loop (`env.rollout`) with an OpenAI client on the episode's gateway URL, and
once a group has ended its rubric scores the group with its own group call
(`rubric.score_group`), so group-level reward functions see every episode of it.

Decisions, stated (classic path):

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
not extend the previous one.
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

NEW_API_VERSION = (0, 4)  # verifiers from this release on: only the new API


def installed_version() -> str:
    """The installed verifiers' version, or a ConfigError saying how to install it."""
    try:
        root = importlib.import_module("verifiers")
    except ImportError as exc:
        if exc.name == "verifiers":
            raise ConfigError(
                "agent.verifiers needs the verifiers package: pip install 'asyncgrpo[verifiers]'"
            ) from exc
        raise ConfigError(f"agent.verifiers: the verifiers package fails to import: {exc}") from exc
    return str(getattr(root, "__version__", "0"))


def new_api(version: str) -> bool:
    """Whether verifiers `version` has the new API only (0.4 and later)."""
    return not _older_than_0_4(version)


def classic_api() -> Any:
    """The classic verifiers package: `verifiers.legacy` (0.3.x) or `verifiers` (< 0.3)."""
    version = installed_version()
    try:
        return importlib.import_module("verifiers.legacy")
    except ImportError:
        pass
    root = importlib.import_module("verifiers")
    if _older_than_0_4(version) and hasattr(root, "load_environment"):
        return root
    raise ConfigError(
        f"agent.verifiers: verifiers {version} has no classic API (verifiers 0.3.x keeps it)"
    )


def _older_than_0_4(version: str) -> bool:
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) < NEW_API_VERSION


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
        raise ConfigError(
            f"agent.verifiers.id: {module_name!r} has no load_environment() (a classic "
            f"environment's entry point), and the installed verifiers {installed_version()} "
            "runs only classic environments. If it is a verifiers 0.4 environment (a package "
            "exporting its Taskset), install verifiers 0.4 ('asyncgrpo[verifiers]') in an "
            "environment of its own: it cannot share one with verifiers 0.3."
        )
    saved = _signal_handlers()
    try:
        env = vf.load_environment(env_id, **args)
    except Exception as exc:
        raise ConfigError(f"agent.verifiers: {exc}") from exc
    finally:
        _restore_signal_handlers(saved)
    if not isinstance(env, vf.Environment):
        raise ConfigError(
            f"agent.verifiers: {module_name}.load_environment() returned a "
            f"{type(env).__name__}, not a classic verifiers Environment"
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
    version = installed_version()
    if new_api(version):
        from asyncgrpo.learning.environments.verifiers_v1 import v1_source

        return v1_source(cfg)
    _no_new_api_settings(section, version)
    vf = classic_api()
    env = load_environment(vf, section.id, dict(section.args))
    _warn_turn_limits(env, cfg.agent.max_turns)
    from asyncgrpo.learning.environments.verifiers_episodes import RubricScorer, VerifiersRollout

    rollout = VerifiersRollout(vf, env, sampling_args(cfg, env))
    train = rows_of(env.get_dataset()) if _has(env, "dataset") else None
    held_out = rows_of(env.get_eval_dataset()) if _has(env, "eval_dataset") else None
    return EpisodeSource(rollout, RubricScorer(env), train_rows=train, eval_rows=held_out)


def _no_new_api_settings(section: Any, version: str) -> None:
    """Settings only verifiers 0.4 reads, refused under the classic API."""
    fields = ("eval_args", "num_tasks", "harness")
    given = [f for f in fields if getattr(section, f) is not None]
    if given:
        raise ConfigError(
            f"agent.verifiers: {given} are settings of verifiers 0.4 environments; the "
            f"installed verifiers {version} runs classic environments (held-out rows come "
            "from the environment's eval_dataset)"
        )


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
