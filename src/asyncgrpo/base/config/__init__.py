"""Typed configuration: one pydantic model per component, validated at load.

A run is described by a YAML file (a recipe) plus `--set key=value` overrides.
Every field has a docstring (shown by `asyncgrpo train --help-config`), and
every mistake is reported by its dotted path: an unknown key suggests the
closest valid name, a mistyped value says what was expected.

Defaults are chosen for the CPU laptop case (SmolLM2-135M on 2 cores) and say
how they were chosen where that is not obvious.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from asyncgrpo.base.config.base import ConfigError, Section, section_types
from asyncgrpo.base.config.cluster import ClusterConfig
from asyncgrpo.base.config.engine import (
    ENGINE_TYPES,
    EmbeddedEngineConfig,
    EngineConfig,
    EngineSettings,
    ExternalEngineConfig,
    ServedEngineSettings,
    VLLMEngineConfig,
    parse_engine_config,
    resolve_dtype,
)
from asyncgrpo.base.config.rollout import (
    AgentConfig,
    CoordinatorConfig,
    LoraConfig,
    ModelConfig,
    RolloutConfig,
)
from asyncgrpo.base.config.sampling import SamplingSettings
from asyncgrpo.base.config.training import AdvantageConfig, LossConfig, TrainerConfig
from asyncgrpo.base.config.trl_names import (
    NO_EQUIVALENT,
    TRL_TARGETS,
    known_names,
    leaf_paths,
    log_notes,
    translate,
)
from asyncgrpo.base.config.variants import (
    describe_engine,
    drop_unset_keys,
    misplaced,
    switch_type,
    untag,
    variant_fields,
)

__all__ = [
    "ENGINE_TYPES",
    "AdvantageConfig",
    "AgentConfig",
    "ClusterConfig",
    "ConfigError",
    "CoordinatorConfig",
    "EmbeddedEngineConfig",
    "EngineConfig",
    "EngineSettings",
    "ExternalEngineConfig",
    "LossConfig",
    "LoraConfig",
    "ModelConfig",
    "RolloutConfig",
    "RunConfig",
    "SamplingSettings",
    "ServedEngineSettings",
    "TrainerConfig",
    "VLLMEngineConfig",
    "build_config",
    "describe",
    "parse_engine_config",
    "load_config",
    "resolve_dtype",
]


class RunConfig(Section):
    """A whole run: one section per component."""

    name: str = "run"
    """Run name; outputs go to `<output_dir>/<name>`."""
    output_dir: str = "runs"
    """Parent directory of run directories."""
    seed: int = 0
    """Seed for data order, sampling and initialisation; fixed seed + staleness 0 is deterministic."""
    max_steps: int = Field(50, ge=1)
    """Optimizer steps to train."""
    max_time_s: float | None = Field(None, gt=0)
    """Optional wall-clock budget; the run checkpoints and stops when it is spent. Spent
    before the run's (or the resumed session's) first optimizer step, it is an error (exit 1;
    `RunAborted` through the API) that says what the run was waiting for."""
    eval_steps: int = Field(10, ge=1)
    """Evaluate held-out reward every this many steps (and before the first)."""
    eval_limit: int | None = Field(None, ge=1)
    """Score only the first N held-out rows in each evaluation (None: all of them). The
    rest stay unseen by training, e.g. for scoring the final weights on a larger set."""
    checkpoint_steps: int = Field(25, ge=1)
    """Checkpoint every this many steps (and at exit)."""
    save_total_limit: int | None = Field(2, ge=1)
    """Checkpoints kept in `checkpoints/` (the newest; None: all). Each holds the weights and
    the optimizer state, about three times the model's size in fp32."""
    save_weights_steps: int | None = Field(None, ge=1)
    """Also write the model weights alone to `weights/step-NNNNNN.safetensors` every this
    many steps, in the engine's dtype (`engine.dtype`: the policy the engine samples with).
    Unlike checkpoints they are all kept, e.g. to score them after the run."""
    best_checkpoint_metric: str | None = "eval_reward_mean"
    """Keep the weights of the best held-out evaluation by this metric of its row in
    metrics.jsonl (`eval_reward_mean`, or another `eval_*` column) in `best/`, with the step
    they are of; `asyncgrpo export` and `save_model` then write the best weights unless asked
    for a step. Costs one copy of the weights in host memory while an evaluation runs. None:
    keep none, and the last step's weights are the run's model."""
    best_checkpoint_mode: Literal["max", "min"] = "max"
    """Whether a larger (`max`) or smaller (`min`) `best_checkpoint_metric` is better."""
    report_to: list[Literal["tensorboard", "wandb", "trackio"]] = []
    """Extra metric sinks besides metrics.jsonl (imported lazily)."""
    dataset: dict[str, Any] = {}
    """Where prompts come from: `{"builtin": NAME, ...}`, `{"path": FILE}` or
    `{"hf": NAME, "split": ...}` (a `datasets` source)."""
    rewards: list[str] = []
    """Reward functions by built-in name or dotted path `package.module:function`."""
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EmbeddedEngineConfig()
    rollout: RolloutConfig = RolloutConfig()
    agent: AgentConfig = AgentConfig()
    coordinator: CoordinatorConfig = CoordinatorConfig()
    loss: LossConfig = LossConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    trainer: TrainerConfig = TrainerConfig()
    cluster: ClusterConfig = ClusterConfig()

    @model_validator(mode="after")
    def _placeable(self) -> RunConfig:
        if self.cluster.launcher != "ray":
            return self
        problem = self.engine.ray_placement_problem()
        if problem:
            raise ValueError(problem)
        return self


def _fields_at(model: type[BaseModel], path: tuple, engine_type: str | None) -> list[str]:
    """Valid field names of the section that `path` points into."""
    if engine_type is not None and len(path) == (1 if model in ENGINE_TYPES.values() else 2):
        return variant_fields(engine_type)
    current: Any = model
    for part in path[:-1]:
        field = current.model_fields.get(part)
        found = section_types(field.annotation) if field else []
        if len(found) != 1:
            return []
        current = found[0]
    return list(current.model_fields)


MOVED = {"model.dtype": "engine.dtype"}
"""Keys that moved between sections, for a precise error on old recipes."""


def _explain(error: ValidationError, model: type[BaseModel]) -> str:
    lines = []
    for err in error.errors():
        path, engine_type, depth = untag(model, tuple(err["loc"]))
        dotted = ".".join(str(p) for p in path)
        wrong_variant = misplaced(path, engine_type, depth)
        if err["type"] == "extra_forbidden" and dotted in MOVED:
            lines.append(f"'{dotted}' moved to '{MOVED[dotted]}'")
        elif err["type"] == "extra_forbidden" and wrong_variant:
            lines.append(wrong_variant)
        elif err["type"] == "extra_forbidden":
            lines.append(f"unknown key '{dotted}'{_hint(model, path, engine_type)}")
        elif err["type"] == "union_tag_invalid":
            types = ", ".join(ENGINE_TYPES)
            lines.append(f"'{dotted}.type': one of {types} (got {err['ctx']['tag']!r})")
        elif err["type"] == "value_error" and not path:  # a check across sections
            lines.append(err["msg"].removeprefix("Value error, "))
        else:
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"'{dotted}': {msg} (got {err.get('input')!r})")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def _hint(model: type[BaseModel], path: tuple, engine_type: str | None = None) -> str:
    """Where an unknown key probably belongs: the TRL name's field, else the closest name."""
    leaf = str(path[-1])
    if leaf in TRL_TARGETS:
        return f"; TRL's '{leaf}' is '{TRL_TARGETS[leaf]}' here"
    if leaf in NO_EQUIVALENT:
        return f"; TRL's '{leaf}' has no equivalent here: {NO_EQUIVALENT[leaf]}"
    if len(path) == 1:  # the top level also takes flat and TRL names
        sections = leaf_paths(model).get(leaf, [])
        if len(sections) > 1:
            return f"; it is in several sections, give one: {', '.join(sections)}"
        names = known_names(model)
        close = difflib.get_close_matches(leaf, list(names), n=1)
        if close:
            where = names[close[0]]
            return f"; did you mean '{close[0]}'" + (f" ('{where}')?" if where != close[0] else "?")
    valid = _fields_at(model, path, engine_type)
    close = difflib.get_close_matches(leaf, valid, n=1)
    return f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(valid)}"


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (['a', 'b'], parsed YAML value)."""
    if "=" not in item:
        raise ConfigError(f"--set expects key=value, got '{item}'")
    key, raw = item.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw) if raw else ""


def build_config(data: dict, overrides: list[str] = (), model: type[BaseModel] = RunConfig):
    """`data` (a recipe) with `key=value` overrides, validated as `model`."""
    recipe = data or {}
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in recipe.items()}
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item}: '{k}' is not a section")
        node[keys[-1]] = value
    notes: list[str] = []
    problems: list[str] = []
    if model is RunConfig:  # TRL's names and flat names, as AsyncGRPOConfig takes them
        data, notes, problems = translate(data, model)
        switch_type(recipe, data)
    drop_unset_keys(model, data)
    try:
        cfg = model.model_validate(data)
    except ValidationError as exc:
        message = _explain(exc, model)
        if problems:
            message += "\n  " + "\n  ".join(problems)
        raise ConfigError(message) from None
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
    log_notes(notes)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML recipe, apply `key=value` overrides, validate."""
    data: dict = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return build_config(data, overrides)


def describe(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """One line per field: dotted name, default and docstring (for --help-config); the
    engine section's fields grouped by the engine types that have them."""
    lines = []
    for name, field in model.model_fields.items():
        found = section_types(field.annotation)
        if len(found) > 1:  # the engine section's variants
            lines += describe_engine(f"{prefix}{name}.", _field_line)
        elif found:
            lines += describe(found[0], f"{prefix}{name}.")
        else:
            lines.append(_field_line(f"{prefix}{name}", field))
    return lines


def _field_line(dotted: str, field: Any) -> str:
    doc = " ".join((field.description or "").split())
    return f"{dotted} = {field.get_default(call_default_factory=True)!r}  # {doc}"
