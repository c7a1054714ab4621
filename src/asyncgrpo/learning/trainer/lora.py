"""LoRA on the trainer side: wrap the policy with `peft`, publish only the adapter.

With `model.lora` set the trained model is a `peft.PeftModel`: the base weights are
frozen and only the low-rank factors A (r, in) and B (out, r) train. At each sync the
trainer publishes the factors alone, under peft's saved names
(`get_peft_model_state_dict`, no adapter name inside), with the scale alpha/r baked
into B, so that every engine applies the same update `W + B @ A` without knowing the
recipe's alpha (one convention for every engine backend).

peft is imported lazily: the core installs without it, and a run without `model.lora`
never imports it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch

from asyncgrpo.base.config import ConfigError, LoraConfig

PEFT_HINT = "pip install 'asyncgrpo[peft]'"
LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
SAVED_PREFIX = "base_model.model."


def import_peft():
    """The `peft` module, or a ConfigError saying how to install it."""
    try:
        import peft
    except ImportError:
        raise ConfigError(f"model.lora needs the peft package: {PEFT_HINT}") from None
    return peft


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """`model` wrapped by peft with a fresh adapter; only the adapter requires grad."""
    peft = import_peft()
    if cfg.target_modules != "all-linear":
        _check_targets(model, list(cfg.target_modules))
    config = peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        task_type="CAUSAL_LM",  # so an exported adapter loads with AutoPeftModelForCausalLM
    )
    return peft.get_peft_model(model, config)


def _check_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """Every target names at least one module, and only linear ones (peft's matching: the
    module's full name, or its last dotted parts)."""
    linear = linear_module_names(model)
    for target in targets:
        matched = [
            module
            for name, module in model.named_modules()
            if name == target or name.endswith("." + target)
        ]
        if not matched:
            raise ConfigError(
                f"model.lora.target_modules: {target!r} matches no module of the model; "
                f"its linear modules are {', '.join(linear)}"
            )
        if not all(isinstance(m, torch.nn.Linear) for m in matched):
            raise ConfigError(
                f"model.lora.target_modules: {target!r} is not a linear module (only linear "
                f"layers take an adapter here); the model's are {', '.join(linear)}"
            )


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's linear modules (`q_proj`, `lm_head`, ...)."""
    names = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }
    return sorted(names)


def is_lora(model: torch.nn.Module) -> bool:
    """True for a peft-wrapped model (never imports peft: unloaded, nothing can be one)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def adapter_weights(
    model: torch.nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(peft saved name, detached copy cast to `dtype`) of each adapter factor; lora_B is
    scaled by its layer's alpha/r, so the update of the base weight is exactly B @ A."""
    for name, tensor in _adapter_tensors(model).items():
        if name.endswith(".lora_B.weight"):
            scale = lora_scaling(model, name)
            yield name, (tensor.detach() * scale).to(dtype or tensor.dtype)
        else:
            yield name, tensor.detach().to(dtype or tensor.dtype, copy=True)


def adapter_nbytes(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes `adapter_weights(model, dtype)` publishes (nothing is copied)."""
    total = 0
    for tensor in _adapter_tensors(model).values():
        itemsize = (dtype or tensor.dtype).itemsize
        total += tensor.numel() * itemsize
    return total


def published_weights(
    model: torch.nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """What a sync publishes: the adapter of a LoRA model, else the whole state dict
    (detached, cast to `dtype` when given)."""
    if is_lora(model):
        yield from adapter_weights(model, dtype)
        return
    for name, tensor in model.state_dict().items():
        yield name, tensor.detach().to(dtype) if dtype is not None else tensor.detach()


def base_weight_name(adapter_name: str) -> str:
    """The base model's weight a published factor updates:
    `base_model.model.X.lora_A.weight` -> `X.weight`."""
    stem = adapter_name.removeprefix(SAVED_PREFIX)
    for suffix in LORA_SUFFIXES:
        if stem.endswith(suffix):
            return stem.removesuffix(suffix) + ".weight"
    raise ValueError(f"{adapter_name!r} is not a LoRA factor name")


def _adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The active adapter's factors under their saved names (tensors share the model's
    storage)."""
    peft = import_peft()
    state = peft.get_peft_model_state_dict(model, adapter_name=model.active_adapter)
    unexpected = [name for name in state if not name.endswith(LORA_SUFFIXES)]
    if unexpected:  # biases or modules_to_save would break the B @ A convention
        raise ConfigError(f"the adapter holds more than LoRA factors: {unexpected[:3]}")
    return state


def lora_scaling(model: torch.nn.Module, saved_name: str) -> float:
    """alpha/r of the layer that owns the factor `...X.lora_A.weight` / `...X.lora_B.weight`
    (the layer's own value, so a per-layer rank or alpha pattern is honoured)."""
    layer = model.get_submodule(saved_name.rsplit(".", 2)[0])
    return float(layer.scaling[model.active_adapter])
