"""verifiers 0.4 environments as episode sources: a taskset package, its tasks, their rewards.

An environment of verifiers 0.4 is a package that exports its `Taskset` (and, for a custom
episode, its `Env`; for a custom agent program, its `Harness`) through `__all__`, as
`vf-init` lays one out. `agent.verifiers.id` names it as `vf-eval` does (the module named
after the id, a Hub id's `owner/` and `@version` dropped), `args` are its taskset's config
fields (`--env.taskset.*`), and verifiers builds the run's `Env` from that config
(`vf.load_environment`): `SingleAgentEnv` for a plain taskset, the package's own `Env`
otherwise. Nothing is downloaded: the package must be installed (or importable from the
working directory).

What asyncgrpo sets in that config, seat by seat (every `AgentConfig` of the env), where the
environment's author left it unset:

- the harness: the taskset's own when its package exports one, else `asyncgrpo-chat`
  (`verifiers_harness`: the chat loop in-process, MCP tools, no shell), or the recipe's
  `agent.verifiers.harness`. verifiers' default, `bash`, would give the policy a shell on
  the training host and fetch its program from the package index;
- the runtime: `subprocess` (verifiers' default is Prime's remote sandboxes);
- `max_turns`: `agent.max_turns`, so verifiers refuses the turn past it (the episode ends
  `max_turns` and is scored) before the gateway would.

Rows: the taskset's first `num_tasks` tasks train, the first `num_eval_tasks` of a second
taskset (`args` with `eval_args` over them) are held out; each row names its task
(`verifiers_task`), with the prompt's text for the logs. A recipe's own `dataset:` rows are
validated as the task's data (`TaskData` fields) instead.

Rewards: one column per `@vf.reward` function of the task (and per plugged judge), named
after it; when the recipe gives no `advantage.reward_weights`, the columns are weighted as
the environment weighs them, so an episode's reward is verifiers' `trace.reward`. Sampling:
`rollout.temperature`, `top_p` and `max_tokens`, plus `agent.verifiers.sampling_args`,
imposed by verifiers on every call (`ModelContext.sampling`); a seat that pins its own
temperature, top_p or max_tokens is refused, since the trainer must agree with the sampler.

How episodes run and end: `verifiers_v1_episodes`; where the environment lives:
`verifiers_v1_host`.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from asyncgrpo.base.config import ConfigError
from asyncgrpo.learning.environments.source import EpisodeSource

logger = logging.getLogger(__name__)

TASK_COLUMN = "verifiers_task"  # a row's task: its index in `TaskBook.tasks`
RELAY_KEY_VAR = "ASYNCGRPO_VERIFIERS_RELAY_KEY"  # unset: the relay needs no key
PINNED_SAMPLING = ("temperature", "top_p", "max_tokens")


def v1_source(cfg: Any) -> EpisodeSource:
    """The episode source of `cfg.agent.verifiers` under verifiers 0.4."""
    import verifiers.v1 as vf

    from asyncgrpo.learning.environments import verifiers_harness
    from asyncgrpo.learning.environments.verifiers_v1_episodes import V1Rewards, V1Rollout
    from asyncgrpo.learning.environments.verifiers_v1_host import EnvHost

    verifiers_harness.register()
    _quiet_library_logs()
    section = cfg.agent.verifiers
    _check_taskset(vf, section.id)
    env = _build("agent.verifiers", lambda: vf.load_environment(env_config(vf, cfg)))
    _check_seats(vf, env.config)
    book = TaskBook(env.taskset)
    train = book.add(first_tasks(env.taskset, section.num_tasks, "num_tasks"))
    held_out = None
    if section.eval_args is not None:
        eval_taskset = _build("agent.verifiers.eval_args", lambda: eval_tasks(vf, section))
        held_out = book.add(first_tasks(eval_taskset, section.num_eval_tasks, "num_eval_tasks"))
    names, weights = reward_columns(book.tasks[0])
    if cfg.advantage.reward_weights is None:
        cfg.advantage.reward_weights = weights
    contexts = model_contexts(vf, cfg)
    host = _build("agent.verifiers: starting the environment", lambda: EnvHost(env, contexts))
    return EpisodeSource(
        V1Rollout(host, book), V1Rewards(names), train, held_out, closers=[host.close]
    )


def _quiet_library_logs() -> None:
    """verifiers logs two lines per rollout, aiohttp one per model call (its access log):
    warnings only, unless the user set their levels."""
    for name in ("verifiers", "aiohttp.access"):
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.WARNING)


def _build(where: str, build: Any) -> Any:
    """`build()`, its failure (a bad config field, a taskset that fails to load) as a
    `ConfigError` naming `where`."""
    from pydantic import ValidationError

    try:
        return build()
    except ConfigError:
        raise
    except ValidationError as exc:  # a field the taskset (or a seat) does not have, ...
        problems = "; ".join(f"{_field_path(e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"{where}: {problems}") from exc
    except Exception as exc:
        raise ConfigError(f"{where}: {type(exc).__name__}: {exc}") from exc


def _field_path(loc: tuple) -> str:
    """A config error's location as the recipe spells it (`taskset.x` is `args.x`)."""
    parts = [str(p) for p in loc]
    return ".".join(["args", *parts[1:]] if parts[:1] == ["taskset"] else parts)


def _check_taskset(vf: Any, env_id: str) -> None:
    """The module of `env_id` exports one `Taskset`, or a clear error (not installed; a
    classic environment, which verifiers 0.4 cannot run)."""
    from verifiers.v1.utils.loaders import taskset_class

    module_name = env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    if "." in module_name:
        _refuse_dotted(module_name)
    try:
        module = vf.import_taskset(env_id)
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"agent.verifiers.id: {exc} Install the environment's package "
            "(`pip install ./my_env`, or from the Environments Hub)."
        ) from exc
    try:
        taskset_class(env_id)
    except (AttributeError, TypeError, ValueError) as exc:
        if hasattr(module, "load_environment"):
            raise _classic(module.__name__) from exc
        raise ConfigError(f"agent.verifiers.id: {exc}") from exc


def _classic(module_name: str) -> ConfigError:
    return ConfigError(
        f"agent.verifiers.id: {module_name!r} is a classic-API environment (its "
        "load_environment() builds a verifiers.Environment), and the installed verifiers "
        "is 0.4, which has only the new API. Train it with verifiers 0.3.x (tested: 0.3.1, "
        "`pip install verifiers==0.3.1`) in an environment of its own, or port it to a Taskset."
    )


def _refuse_dotted(module_name: str) -> None:
    """verifiers 0.4 imports a package by name; a dotted path is a classic habit."""
    try:
        module = importlib.import_module(module_name)
    except Exception:  # a classic module written against verifiers < 0.4 may fail to import
        module = None
    if module is not None and hasattr(module, "load_environment"):
        raise _classic(module_name)
    raise ConfigError(
        f"agent.verifiers.id: {module_name!r} is a dotted path; verifiers 0.4 imports an "
        "environment by its package's name (`my-env` for the package my_env): install the "
        "package, or run from the directory that holds it"
    )


def env_config(vf: Any, cfg: Any) -> Any:
    """The verifiers `EnvConfig` of the run (see the module docstring for what is set)."""
    section = cfg.agent.verifiers
    config_type = vf.env_config_type(section.id)
    own_harness = vf.default_harness_id(section.id) != "bash"  # the package exports one
    raw: dict[str, Any] = {"taskset": {**section.args, "id": section.id}}
    for name, field in config_type.model_fields.items():
        seat = field.default
        if isinstance(seat, vf.AgentConfig):
            raw[name] = seat_settings(seat, cfg, own_harness)
    return config_type.model_validate(raw)


def seat_settings(seat: Any, cfg: Any, own_harness: bool) -> dict[str, Any]:
    """What a seat gets where its author left it unset (merged over the seat's default)."""
    from asyncgrpo.learning.environments.verifiers_harness import HARNESS_ID

    section, out = cfg.agent.verifiers, {}
    if seat.harness is None and (section.harness is not None or not own_harness):
        harness = {"id": HARNESS_ID, "call_timeout_s": cfg.agent.call_timeout_s}
        chosen = dict(section.harness or {})  # its knobs alone: asyncgrpo-chat's
        out["harness"] = chosen if "id" in chosen else {**harness, **chosen}
    if "runtime" not in seat.model_fields_set:
        out["runtime"] = {"type": "subprocess"}
    if seat.max_turns is None:
        out["max_turns"] = cfg.agent.max_turns
    return out


def _check_seats(vf: Any, config: Any) -> None:
    for name, value in config:
        if isinstance(value, vf.AgentConfig) and value.sampling is not None:
            pinned = [k for k in PINNED_SAMPLING if getattr(value.sampling, k) is not None]
            if pinned:
                raise ConfigError(
                    f"agent.verifiers: the environment's seat {name!r} pins sampling "
                    f"{pinned}; these come from the rollout section, which the trainer uses too"
                )


def eval_tasks(vf: Any, section: Any) -> Any:
    """The held-out taskset: `args` with `eval_args` over them."""
    fields = {**section.args, **(section.eval_args or {}), "id": section.id}
    return vf.load_taskset(vf.taskset_config_type(section.id).model_validate(fields))


def first_tasks(taskset: Any, limit: int | None, setting: str) -> list:
    """The taskset's first `limit` tasks (all of a finite one without a limit)."""
    if limit is None and not taskset.bounded:
        raise ConfigError(
            f"agent.verifiers: the taskset {taskset.config.id!r} never ends (INFINITE): "
            f"set agent.verifiers.{setting}"
        )
    try:
        tasks = list(taskset.take(limit) if limit is not None else taskset)
    except Exception as exc:
        raise ConfigError(
            f"agent.verifiers: the taskset {taskset.config.id!r} failed to load its tasks: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not tasks:
        raise ConfigError(f"agent.verifiers: the taskset {taskset.config.id!r} has no tasks")
    return tasks


class TaskBook:
    """The run's tasks, addressed by the rows (`TASK_COLUMN`); a row without that column
    (a recipe's own dataset) is validated as the task's data."""

    def __init__(self, taskset: Any):
        self.task_type = type(taskset).task_type()
        self.task_config = taskset.config.task
        self.tasks: list = []

    def add(self, tasks: list) -> list[dict]:
        start = len(self.tasks)
        self.tasks.extend(tasks)
        return [{"prompt": t.data.prompt_text, TASK_COLUMN: start + i} for i, t in enumerate(tasks)]

    def task_of(self, row: dict) -> Any:
        index = row.get(TASK_COLUMN)
        if index is not None:
            return self.tasks[index]
        data = self.task_type.data_type().model_validate(row)
        return self.task_type(data, self.task_config)


def reward_columns(task: Any) -> tuple[list[str], list[float]]:
    """(the reward names, their weights): the task's `@vf.reward` functions (plugged ones
    included), then its plugged judges, as verifiers records them on a trace."""
    names = [fn.__name__ for fn in task.hooks("reward")]
    weights = [float(getattr(fn, "_vf_weight", 1.0)) for fn in task.hooks("reward")]
    for judge in task.plugged_judges():
        names.append(judge.reward_name)
        weights.append(float(judge.config.weight))
    if not names:
        raise ConfigError(
            f"agent.verifiers: the task {type(task).__name__} declares no reward "
            "(a @vf.reward method, a plugged reward or judge): there is nothing to train on"
        )
    if len(set(names)) != len(names):
        raise ConfigError(f"agent.verifiers: reward names repeat: {names}")
    return names, weights


def model_contexts(vf: Any, cfg: Any) -> Any:
    """`(relay_url, model) -> ModelContext`: the relay as the endpoint, the run's sampling."""
    r = cfg.rollout
    sampling = vf.SamplingConfig.model_validate(
        {
            **cfg.agent.verifiers.sampling_args,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "max_tokens": r.max_tokens,
        }
    )
    clients: dict[str, Any] = {}

    def context(relay_url: str, model: str) -> Any:
        if relay_url not in clients:
            clients[relay_url] = vf.EvalClientConfig(base_url=relay_url, api_key_var=RELAY_KEY_VAR)
        return vf.ModelContext(model=model, client=clients[relay_url], sampling=sampling)

    return context
