"""TRL's `GRPOConfig` names and flat field names, moved to their place in a `RunConfig`.

A TRL user writes `AsyncGRPOConfig(max_completion_length=256, loss_type="dr_grpo",
per_device_train_batch_size=16, ...)`, and a recipe or `--set` may use the same flat
names. `translate` rewrites such top-level keys before validation:

- a TRL name becomes the field that means the same here (`save_steps` ->
  `checkpoint_steps`), with its value converted where TRL counts differently
  (`per_device_train_batch_size` counts completions, `coordinator.batch_groups` prompts);
  where the meaning differs, a one-line note is logged once per process;
- a leaf name unique across sections (`learning_rate`) becomes its dotted path;
- a TRL name with no equivalent here is a problem, reported together with every other
  mistake of the config in one error (nothing is silently ignored but `logging_steps`,
  whose job, per-step metrics, is always done, and `top_k` / `repetition_penalty` at
  their neutral values, which sample as we do).

TRL names take precedence over our flat names: `epsilon` is TRL's clip range, not
`advantage.epsilon`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from asyncgrpo.base.config.base import section_types

logger = logging.getLogger(__name__)


class Unsupported(ValueError):
    """A TRL name or value with no equivalent here; the message says what to use."""


# name -> why there is no equivalent (and what to use instead)
NO_EQUIVALENT = {
    "num_train_epochs": "training length is max_steps (or max_time_s); prompts cycle",
    "num_iterations": "each batch is trained on once",
}

AGGREGATIONS = ("grpo", "bnpo", "dr_grpo", "dapo")
# our warmup precedes every schedule, so TRL's constant_with_warmup is our constant
SCHEDULES = {
    "constant": "constant",
    "constant_with_warmup": "constant",
    "linear": "linear",
    "cosine": "cosine",
}
SINKS = ("tensorboard", "wandb", "trackio")

Ctx = dict[str, Any]  # the user's other top-level values and the defaults, by flat name
Rule = Callable[[Any, Ctx], tuple[dict[str, Any], str | None]]


def _same(path: str, note: str | None = None) -> Rule:
    return lambda value, ctx: ({path: value}, note)


def _loss_type(value: Any, ctx: Ctx) -> tuple[dict, str | None]:
    if value in AGGREGATIONS:
        return {"loss.aggregation": value}, None
    if value == "cispo":  # TRL's cispo normalises by the global token count: dapo's
        return {"loss.name": "cispo", "loss.aggregation": "dapo"}, None
    raise Unsupported(
        f"loss_type={value!r} has no equivalent; use one of {', '.join(AGGREGATIONS)} "
        "(loss.aggregation) or cispo, or pick loss.name (clipped, cispo, decoupled_ppo)"
    )


def _epsilon(value: Any, ctx: Ctx) -> tuple[dict, str | None]:
    # TRL: epsilon_high defaults to epsilon
    if "epsilon_high" in ctx["given"]:
        return {"loss.epsilon_low": value}, None
    return {"loss.epsilon_low": value, "loss.epsilon_high": value}, None


def _batch(value: Any, ctx: Ctx) -> tuple[dict, str | None]:
    per_device = ctx.get("per_device_train_batch_size", 8)  # TRL's default
    accumulation = ctx.get("gradient_accumulation_steps", 1)
    generations = ctx["num_generations"]
    for name, count in (
        ("per_device_train_batch_size", per_device),
        ("gradient_accumulation_steps", accumulation),
    ):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise Unsupported(f"{name} must be a positive integer (got {count!r})")
    completions = per_device * accumulation
    if completions % generations:
        raise Unsupported(
            f"per_device_train_batch_size × gradient_accumulation_steps = {completions} "
            f"completions per step must be a multiple of num_generations={generations}"
        )
    groups = completions // generations
    note = (
        f"{completions} completions per step (per_device_train_batch_size × "
        f"gradient_accumulation_steps) = coordinator.batch_groups={groups} prompts × "
        f"num_generations={generations}; micro-batches are sized by trainer.micro_batch_tokens"
    )
    return {"coordinator.batch_groups": groups}, note


def _warmup_ratio(value: Any, ctx: Ctx) -> tuple[dict, str | None]:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise Unsupported(f"warmup_ratio must be a number in [0, 1] (got {value!r})")
    steps = round(value * ctx["max_steps"])
    note = f"warmup_ratio={value} -> trainer.warmup_steps={steps} (of max_steps={ctx['max_steps']})"
    return {"trainer.warmup_steps": steps}, note


def _schedule(value: Any, ctx: Ctx) -> tuple[dict, str | None]:
    if value not in SCHEDULES:
        raise Unsupported(
            f"lr_scheduler_type={value!r} has no equivalent; one of {', '.join(SCHEDULES)}"
        )
    return {"trainer.lr_schedule": SCHEDULES[value]}, None


# the trainer recomputes log-probs of the distribution the engine sampled from, which is
# shaped by temperature and top_p only: other sampling settings pass at their neutral value
SAMPLING = (
    "rollout sampling has temperature and top_p only (the trainer recomputes log-probs of "
    "the engine's distribution)"
)


def _neutral(name: str, neutral: tuple, what: str) -> Rule:
    """A sampling setting accepted at its neutral (disabled) values only."""

    def rule(value: Any, ctx: Ctx) -> tuple[dict, str | None]:
        if not isinstance(value, bool) and value in neutral:
            return {}, None
        raise Unsupported(
            f"{name}={value!r} (TRL) has no equivalent here: {SAMPLING}; leave it at {what}"
        )

    return rule


def _use_vllm(value: Any, ctx: Ctx) -> tuple[dict, str | None]:
    if not value:
        return {}, None
    if ctx.get("vllm_mode", "colocate") == "colocate":
        note = "use_vllm: vLLM runs as a server process asyncgrpo launches (engine.type vllm)"
        return {"engine.type": "vllm"}, note
    return {"engine.type": "vllm", "engine.base_url": _server_url(ctx)}, (
        "vllm_mode server: attaches to a vLLM server started as docs/vllm.md "
        "says (TRL's `trl vllm-serve` has other routes)"
    )


def _server_url(ctx: Ctx) -> str:
    """TRL's server address: the base URL, else host and port (0.0.0.0:8000 by default)."""
    if ctx.get("vllm_server_base_url"):
        return ctx["vllm_server_base_url"]
    host = ctx.get("vllm_server_host", "0.0.0.0")
    host = "127.0.0.1" if host in ("0.0.0.0", "", None) else host  # TRL connects to this host
    return f"http://{host}:{ctx.get('vllm_server_port', 8000)}"


def _vllm_mode(value: Any, ctx: Ctx) -> tuple[dict, str | None]:
    if value not in ("server", "colocate"):
        raise Unsupported(f"vllm_mode={value!r}: expected 'server' or 'colocate'")
    return {}, None  # read by use_vllm


def _read_by_use_vllm(value: Any, ctx: Ctx) -> tuple[dict, str | None]:
    return {}, None  # vllm_server_base_url / _host / _port: the server mode's address


def _report_to(value: Any, ctx: Ctx) -> tuple[dict, str | None]:
    sinks = [value] if isinstance(value, str) else list(value or [])
    if "all" in sinks:
        raise Unsupported(f"report_to='all': name the sinks, from {', '.join(SINKS)}")
    return {"report_to": [s for s in sinks if s != "none"]}, None


def _scale_rewards(value: Any, ctx: Ctx) -> tuple[dict, str | None]:
    if isinstance(value, bool):
        value = "group" if value else "none"
    return {"advantage.scale_rewards": value}, None


def _tool_iterations(value: Any, ctx: Ctx) -> tuple[dict, str | None]:
    """TRL counts tool rounds after the first reply; agent.max_turns counts every reply."""
    if value is None:  # TRL: unbounded
        return {}, "max_tool_calling_iterations=None: agent.max_turns bounds each episode"
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Unsupported(f"max_tool_calling_iterations must be an integer >= 0 (got {value!r})")
    return {"agent.max_turns": value + 1}, None


IS_MODE = "vllm_importance_sampling_mode"
IS_NAMES = ("vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max")
IS_MODES = {  # TRL's modes, and why one has no equivalent with the bounds given
    "token_mask": f"needs {IS_NAMES[0]} and {IS_NAMES[1]} (0 < min < 1 < max; IcePop: 0.5, 5)",
    "token_truncate": f"clips from above only here (loss.correction_cap): no {IS_NAMES[0]}",
    "sequence_truncate": f"clips from above only here (loss.correction_cap): no {IS_NAMES[0]}",
    "sequence_mask": "weighs a kept sequence by its ratio, loss.correction=sequence_mask by 1",
}


def _is_mode(value: Any, ctx: Ctx) -> tuple[dict, str | None]:
    """TRL's engine-trainer importance weights as `loss.correction` where they mean the
    same: `token_mask` (ρ kept inside [C_min, C_max]) is `masked_is`; a truncation from
    above (`*_truncate` without C_min) is ours."""
    if ctx.get("vllm_importance_sampling_correction", True) is False:
        return {"loss.correction": "none"}, None
    low = ctx.get(IS_NAMES[0])
    high = ctx.get(IS_NAMES[1], ctx.get("vllm_importance_sampling_cap", 3.0))
    if value == "token_mask" and None not in (low, high):
        bounds = {"loss.masked_is_low": low, "loss.masked_is_high": high}
        return {"loss.correction": "masked_is", **bounds}, None
    if value in ("token_truncate", "sequence_truncate") and not low and high is not None:
        return {"loss.correction": value, "loss.correction_cap": high}, None
    why = IS_MODES.get(value, f"is one of {', '.join(IS_MODES)}")
    raise Unsupported(f"{IS_MODE}={value!r} (TRL) {why}")


def _is_setting(value: Any, ctx: Ctx) -> tuple[dict, str | None]:
    """vllm_importance_sampling_correction / _clip_min / _clip_max / _cap: read by
    `_is_mode`; without a mode, TRL's default (sequence_mask) applies there."""
    if IS_MODE in ctx["given"]:
        return {}, None
    if ctx.get("vllm_importance_sampling_correction", True) is False:
        return {"loss.correction": "none"}, None
    if value is True:  # the switch alone, at TRL's default
        return {}, "vllm_importance_sampling_correction: loss.correction applies (not TRL's mode)"
    raise Unsupported(f"vllm_importance_sampling_clip_* (TRL) need {IS_MODE} (TRL's default, "
                      f"sequence_mask, {IS_MODES['sequence_mask']})")  # fmt: skip


def _load_best(value: Any, ctx: Ctx) -> tuple[dict, str | None]:
    """True is the default here: the best evaluation's weights are kept and exported."""
    return ({}, None) if value else ({"best_checkpoint_metric": None}, None)


def _best_metric(value: Any, ctx: Ctx) -> tuple[dict, str | None]:
    """TRL's `metric_for_best_model` ("reward", "eval_reward", ...) as an eval row's column."""
    if ctx.get("load_best_model_at_end") is False:
        return {}, None
    name = str(value) if str(value).startswith("eval_") else f"eval_{value}"
    if name == "eval_loss":
        raise Unsupported(
            "metric_for_best_model='loss': evaluations here score held-out reward, not a loss; "
            "use 'reward' (eval_reward_mean) or another eval_* column of metrics.jsonl"
        )
    return {"best_checkpoint_metric": "eval_reward_mean" if name == "eval_reward" else name}, None


TRL_RULES: dict[str, Rule] = {
    "max_completion_length": _same("rollout.max_tokens"),
    "loss_type": _loss_type,
    "epsilon": _epsilon,
    "importance_sampling_level": _same("loss.ratio_level"),
    "save_steps": _same("checkpoint_steps"),
    "logging_steps": lambda value, ctx: (
        {},
        "logging_steps: metrics are logged at every step (metrics.jsonl); it is ignored",
    ),
    "per_device_train_batch_size": _batch,
    "gradient_accumulation_steps": _batch,
    "bf16": _same(
        "trainer.bf16_autocast",
        "bf16 -> trainer.bf16_autocast (the trainer's forward); the engine samples in engine.dtype",
    ),
    "warmup_ratio": _warmup_ratio,
    "lr_scheduler_type": _schedule,
    "run_name": _same("name"),
    "use_vllm": _use_vllm,
    "vllm_mode": _vllm_mode,
    "vllm_server_base_url": _read_by_use_vllm,
    "vllm_server_host": _read_by_use_vllm,
    "vllm_server_port": _read_by_use_vllm,
    "report_to": _report_to,
    "scale_rewards": _scale_rewards,
    "max_tool_calling_iterations": _tool_iterations,
    IS_MODE: _is_mode,
    **{
        f"vllm_importance_sampling_{k}": _is_setting
        for k in ("correction", "clip_min", "clip_max", "cap")
    },
    "load_best_model_at_end": _load_best,
    "metric_for_best_model": _best_metric,
    "greater_is_better": lambda value, ctx: (
        {"best_checkpoint_mode": "max" if value else "min"},
        None,
    ),
    "top_k": _neutral("top_k", (0, -1, None), "0 (disabled, TRL's default)"),
    "repetition_penalty": _neutral("repetition_penalty", (1.0,), "1.0 (TRL's default)"),
}

# where a TRL name lands, for hints on a misplaced one (`trainer.save_steps`)
TRL_TARGETS = {
    "max_completion_length": "rollout.max_tokens",
    "loss_type": "loss.aggregation",
    "epsilon": "loss.epsilon_low",
    "importance_sampling_level": "loss.ratio_level",
    "save_steps": "checkpoint_steps",
    "per_device_train_batch_size": "coordinator.batch_groups",
    "gradient_accumulation_steps": "coordinator.batch_groups",
    "bf16": "trainer.bf16_autocast",
    "warmup_ratio": "trainer.warmup_steps",
    "lr_scheduler_type": "trainer.lr_schedule",
    "run_name": "name",
    "use_vllm": "engine.type",
    "vllm_server_base_url": "engine.base_url",
    "max_prompt_length": "rollout.max_prompt_length",
    "mask_truncated_completions": "loss.mask_truncated_completions",
    "max_tool_calling_iterations": "agent.max_turns",
    IS_MODE: "loss.correction",
    "load_best_model_at_end": "best_checkpoint_metric",
    "metric_for_best_model": "best_checkpoint_metric",
    "greater_is_better": "best_checkpoint_mode",
    IS_NAMES[0]: "loss.masked_is_low",
    IS_NAMES[1]: "loss.masked_is_high",
}


@functools.cache
def leaf_paths(model: type[BaseModel]) -> dict[str, list[str]]:
    """Leaf field name -> every dotted path that ends with it."""
    paths: dict[str, list[str]] = {}

    def walk(section: type[BaseModel], prefix: str) -> None:
        for name, field in section.model_fields.items():
            variants = section_types(field.annotation)  # several for the engine's types
            for found in variants:
                walk(found, f"{prefix}{name}.")
            found_at = paths.setdefault(name, [])
            if not variants and f"{prefix}{name}" not in found_at:
                found_at.append(f"{prefix}{name}")

    walk(model, "")
    return paths


def flat_fields(model: type[BaseModel]) -> dict[str, str]:
    """Leaf field name -> dotted path, for names unique across sections and top-level ones."""
    flat = {leaf: found[0] for leaf, found in leaf_paths(model).items() if len(found) == 1}
    flat.update({name: name for name in model.model_fields})  # top-level names win
    return flat


def known_names(model: type[BaseModel]) -> dict[str, str]:
    """Every top-level name accepted -> where it lands (for did-you-mean hints)."""
    names = {name: name for name in model.model_fields}
    names.update(flat_fields(model))
    names.update({name: TRL_TARGETS.get(name, name) for name in TRL_RULES})
    return names


_noted: set[str] = set()


def _note_once(note: str) -> None:
    if note not in _noted:
        _noted.add(note)
        logger.warning("TRL name: %s", note)


def translate(data: dict, model: type[BaseModel]) -> tuple[dict, list[str], list[str]]:
    """(data with top-level TRL and flat names at their dotted place, notes, problems).

    Unknown names stay where they are, for validation to report with a hint."""
    flat = flat_fields(model)
    ctx = _context(data, model)
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    moved: dict[str, Any] = {}
    notes: list[str] = []
    problems: list[str] = []
    for key, value in data.items():
        if key in NO_EQUIVALENT:
            problems.append(f"'{key}' (TRL) has no equivalent here: {NO_EQUIVALENT[key]}")
        elif key in TRL_RULES:
            _apply(TRL_RULES[key], value, ctx, moved, notes, problems)
        elif key not in model.model_fields and key in flat:
            moved[flat[key]] = value
        else:
            continue
        out.pop(key, None)
    for path, value in moved.items():
        _assign(out, path, value, problems)
    return out, notes, problems


def _apply(rule: Rule, value: Any, ctx: Ctx, moved: dict, notes: list, problems: list) -> None:
    try:
        assigned, note = rule(value, ctx)
    except Unsupported as exc:
        if str(exc) not in problems:  # the batch rule runs for two names
            problems.append(str(exc))
        return
    moved.update(assigned)
    if note and note not in notes:
        notes.append(note)


def log_notes(notes: list[str]) -> None:
    """Log each note once per process."""
    for note in notes:
        _note_once(note)


def _assign(data: dict, path: str, value: Any, problems: list[str]) -> None:
    *parents, leaf = path.split(".")
    node = data
    for part in parents:
        child = node.get(part, {})
        if not isinstance(child, dict):
            problems.append(f"'{part}' must be a section (a mapping) to hold '{path}'")
            return
        node[part] = child = dict(child)
        node = child
    node[leaf] = value


def _context(data: dict, model: type[BaseModel]) -> Ctx:
    """The user's top-level values, with the values the TRL rules depend on resolved."""
    ctx: Ctx = dict(data)
    for path in ("rollout.num_generations", "max_steps"):
        leaf = path.rsplit(".", 1)[-1]
        if leaf not in ctx:
            ctx[leaf] = _nested(data, path, _default(model, path))
    nested_high = _nested(data, "loss.epsilon_high", _MISSING) is not _MISSING
    ctx["given"] = set(data) | ({"epsilon_high"} if nested_high else set())
    return ctx


_MISSING = object()


def _nested(data: dict, path: str, default: Any = None) -> Any:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _default(model: type[BaseModel], path: str) -> Any:
    node: Any = model()
    for part in path.split("."):
        node = getattr(node, part)
    return node
