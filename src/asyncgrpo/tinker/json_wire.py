"""The JSON bodies of the Tinker routes, read field by field with errors that name the field.

The SDK serialises its pydantic request types with `exclude_none=True`, so an absent key
and a JSON `null` mean the same here: the SDK's default. Each reader refuses a wrong type
with a `TinkerUserError` naming the dotted field, which the server sends back as a user
error. `create_model` and `optim_step` get parsers of their own because their defaults and
bounds matter to training (Adam's defaults are the SDK's `AdamParams` ones, not torch's);
the other routes carry a few strings that the app reads with `read_field`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from asyncgrpo.learning.trainer.datums import AdamParams
from asyncgrpo.tinker.errors import TinkerUserError
from asyncgrpo.tinker.limits import TinkerLimits

REQUIRED: Any = object()
"""`read_field`'s default: the key must be present (and not null)."""

_KIND_NAMES = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "a string",
    dict: "a JSON object",
}


def read_field(body: Any, key: str, kind: type, *, prefix: str = "", default: Any = REQUIRED):
    """`body[key]` as `kind` (int, float, bool or str); `default` when absent or null.

    Booleans are not integers here, and a float must be finite.
    """
    where = f"{prefix}.{key}" if prefix else key
    if not isinstance(body, dict):
        raise TinkerUserError(prefix, "must be a JSON object")
    value = body.get(key)
    if value is None:
        if default is REQUIRED:
            raise TinkerUserError(where, "is required")
        return default
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise TinkerUserError(where, f"must be {_KIND_NAMES[kind]}, got {_shown(value)}")
    return float(value) if kind is float else value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def refuse_unknown_keys(body: dict, known: set[str], prefix: str) -> None:
    """A key the SDK's (strict) request type would not have sent is a typo: name it."""
    for key in sorted(set(body) - known):
        raise TinkerUserError(
            f"{prefix}.{key}", "is not a field here; known: " + ", ".join(sorted(known))
        )


# the SDK's `AdamParams` defaults (its learning rate too: the trainer's own has none)
ADAM_DEFAULTS = dict(
    learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0
)


def decode_adam_params(params: Any, prefix: str = "adam_params") -> AdamParams:
    """Adam's hyperparameters from the SDK's `adam_params` object, checked for range."""
    if isinstance(params, dict) and "type" in params:
        raise TinkerUserError(
            f"{prefix}.type", f"optimizer {params['type']!r} is not served: Adam only"
        )
    values = {
        name: read_field(params, name, float, prefix=prefix, default=default)
        for name, default in ADAM_DEFAULTS.items()
    }
    refuse_unknown_keys(params, set(values), prefix)
    adam = SimpleNamespace(**values)
    for name, ok, rule in (
        ("learning_rate", adam.learning_rate >= 0, ">= 0"),
        ("beta1", 0 <= adam.beta1 < 1, "in [0, 1)"),
        ("beta2", 0 <= adam.beta2 < 1, "in [0, 1)"),
        ("eps", adam.eps > 0, "> 0"),
        ("weight_decay", adam.weight_decay >= 0, ">= 0"),
        ("grad_clip_norm", adam.grad_clip_norm >= 0, ">= 0 (0 turns clipping off)"),
    ):
        if not ok:
            raise TinkerUserError(f"{prefix}.{name}", f"must be {rule}, got {values[name]}")
    return AdamParams(**values)


@dataclass(frozen=True)
class OptimStepCall:
    """A decoded `optim_step` request."""

    model_id: str
    seq_id: int
    adam: AdamParams


def decode_optim_step(body: Any) -> OptimStepCall:
    """`{model_id, seq_id, adam_params}`; another optimizer family is refused."""
    model_id = read_field(body, "model_id", str)
    seq_id = read_field(body, "seq_id", int, default=0)
    if "optimizer_params" in body:
        raise TinkerUserError("optimizer_params", "only Adam is served (send adam_params)")
    key = "adam_params" if "adam_params" in body else "optim_params"
    params = body.get(key)
    adam = decode_adam_params({} if params is None else params, key)
    return OptimStepCall(model_id=model_id, seq_id=seq_id, adam=adam)


@dataclass(frozen=True)
class CreateModelCall:
    """A decoded `create_model` request: a LoRA adapter on the served base model."""

    session_id: str
    model_seq_id: int
    base_model: str
    rank: int
    seed: int | None
    train_mlp: bool
    train_attn: bool
    train_unembed: bool
    user_metadata: dict | None = None

    @property
    def model_id(self) -> str:
        """The id the SDK assumes without asking (`ServiceClient` builds it the same way)."""
        return f"{self.session_id}:train:{self.model_seq_id}"


def decode_create_model(body: Any, limits: TinkerLimits) -> CreateModelCall:
    """`{session_id, model_seq_id, base_model, lora_config, optimizer_config?}`."""
    lora = body.get("lora_config") if isinstance(body, dict) else None
    if lora is None:
        raise TinkerUserError("lora_config", "is required: this server trains LoRA adapters")
    optimizer = read_field(body, "optimizer_config", dict, default={"type": "adamw"})
    if optimizer.get("type") != "adamw":
        raise TinkerUserError(
            "optimizer_config.type", f"optimizer {optimizer.get('type')!r} is not served: adamw"
        )
    rank = read_field(lora, "rank", int, prefix="lora_config")
    if not 1 <= rank <= limits.max_lora_rank:
        raise TinkerUserError(
            "lora_config.rank", f"must be in [1, {limits.max_lora_rank}], got {rank}"
        )
    flags = {
        name: read_field(lora, name, bool, prefix="lora_config", default=True)
        for name in ("train_mlp", "train_attn", "train_unembed")
    }
    refuse_unknown_keys(lora, {"rank", "seed", *flags}, "lora_config")
    if not any(flags.values()):
        raise TinkerUserError("lora_config", "trains nothing: set one of train_mlp/attn/unembed")
    return CreateModelCall(
        session_id=read_field(body, "session_id", str),
        model_seq_id=read_field(body, "model_seq_id", int),
        base_model=read_field(body, "base_model", str),
        rank=rank,
        seed=read_field(lora, "seed", int, prefix="lora_config", default=None),
        user_metadata=read_field(body, "user_metadata", dict, default=None),
        **flags,
    )
