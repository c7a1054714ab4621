"""Recipe sections for environments users already have: OpenEnv servers, verifiers environments.

TRL's environment classes need no section of their own: `agent.environment` names the
class. Each section here is read by its adapter in `asyncgrpo.learning.environments`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from asyncgrpo.base.config.base import Section


class OpenEnvConfig(Section):
    """An OpenEnv environment server: one WebSocket session per episode."""

    url: str | None = None
    """Base URL of a running server (`http://host:port`); its `/ws` route is used."""
    app: str | None = None
    """`package.module:app` (an ASGI app, as `create_app(...)` returns): asyncgrpo serves it
    on 127.0.0.1 at a free port for the run and stops it at the end."""
    message_timeout_s: float = Field(60.0, gt=0)
    """Deadline of one reset or step message; past it the episode is an infra_error."""
    startup_timeout_s: float = Field(60.0, gt=0)
    """With `app`: how long the server may take to answer `/health` before the run stops."""
    prompt: str | list[dict[str, Any]] | None = None
    """What every episode opens with, before its row's `prompt` and the first observation:
    a user message's text, or chat messages (a system prompt, a worked example). The first
    observation is appended to the last user message, or follows as a new one."""
    seeds: int = Field(1000, ge=1)
    """Without a `dataset:`, the training rows are `{"seed": 0}` ... `{"seed": seeds - 1}`:
    each episode calls `reset(seed=...)`, and a group's episodes share their row's seed."""
    eval_seeds: int = Field(32, ge=0)
    """Held-out rows without a `dataset:`: the seeds after the training ones."""

    @model_validator(mode="after")
    def _one_server(self) -> OpenEnvConfig:
        if (self.url is None) == (self.app is None):
            raise ValueError("give exactly one of `url` (a running server) or `app` (module:app)")
        return self


class VerifiersConfig(Section):
    """A verifiers environment, read by whichever verifiers is installed: 0.4's environments
    (a package exporting its `Taskset`, configured by its taskset's fields) or the classic
    API of verifiers 0.3 (`load_environment(**args)`)."""

    id: str
    """The environment's id: the module named after it is imported (dashes read as
    underscores, a Hub id's `owner/` dropped, and with verifiers 0.4 its `@version`), as
    verifiers does."""
    args: dict[str, Any] = {}
    """verifiers 0.4: the taskset's config fields (`--env.taskset.*` of `vf-eval`, `task`
    included). Classic API: keyword arguments of its `load_environment`."""
    sampling_args: dict[str, Any] = {}
    """Chat-call arguments merged over the environment's own (e.g. `stop`, `extra_body`).
    Temperature, top_p and max_tokens come from the `rollout` section (the trainer must
    use the same temperature and top_p)."""
    eval_args: dict[str, Any] | None = None
    """verifiers 0.4: the held-out tasks are a second taskset, configured by `args` with
    these fields over them (e.g. `{split: test}`); None: no held-out tasks from the
    environment (a classic environment brings its own `eval_dataset`)."""
    num_tasks: int | None = Field(None, ge=1)
    """verifiers 0.4: the first `num_tasks` tasks of the taskset train (None: all of them;
    an infinite taskset needs a number)."""
    num_eval_tasks: int = Field(32, ge=1)
    """verifiers 0.4: at most this many held-out tasks (the first of the `eval_args`
    taskset)."""
    harness: dict[str, Any] | None = None
    """verifiers 0.4: the harness config of every seat that does not pin one (`id` and its
    knobs). None: the taskset's own harness when its package exports one, else asyncgrpo's
    in-process chat loop (`asyncgrpo-chat`)."""

    @field_validator("sampling_args")
    @classmethod
    def _not_the_recipes(cls, value: dict[str, Any]) -> dict[str, Any]:
        owned = {"temperature", "top_p", "max_tokens", "max_completion_tokens", "n"}
        clash = sorted(owned & set(value))
        if clash:
            raise ValueError(
                f"{clash} come from the rollout section (rollout.temperature, rollout.top_p, "
                "rollout.max_tokens; one completion per call), not from sampling_args"
            )
        return value
