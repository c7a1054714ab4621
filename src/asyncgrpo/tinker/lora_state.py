"""One adapter of a multi-adapter peft model as plain named tensors, and back.

`training.LoraModels` keeps several adapters on one peft model; saving, restoring and
publishing one of them goes through its factors by peft's *saved* names
(`base_model.model.<module>.lora_A.weight`, no adapter name inside), the names the engine
syncs (`adapters.py`) and a PEFT adapter file uses. Adam's moments are keyed by the same
names (`optimizer.<saved name>.<key>`), so a state never depends on parameter order; so are
the gradients a model has accumulated and not yet stepped on (`gradient.<saved name>`),
which a model taken out of memory between its `forward_backward` and its `optim_step`
(`offload.py`) carries with it.

Why not `trainer/lora.adapter_weights`: on a model with tied embeddings and `lm_head`
targeted, peft's `get_peft_model_state_dict` adds the base head weight
(`save_embedding_layers="auto"`); here the factors are read from the parameters directly.
"""

from __future__ import annotations

import torch

from asyncgrpo.learning.trainer.lora import LORA_SUFFIXES, SAVED_PREFIX
from asyncgrpo.tinker.errors import TinkerUserError

OPTIMIZER_PREFIX = "optimizer."
GRADIENT_PREFIX = "gradient."
STATE_FIELD = "path"


def adapter_factors(peft_model, adapter: str) -> dict[str, torch.nn.Parameter]:
    """Saved name -> the live parameter, for each LoRA factor of `adapter`."""
    marker = f".{adapter}."
    factors = {}
    for name, param in peft_model.named_parameters():
        if marker not in name:
            continue
        saved = name.replace(marker, ".")
        if not (saved.startswith(SAVED_PREFIX) and saved.endswith(LORA_SUFFIXES)):
            raise ValueError(f"adapter parameter {name!r} is not a LoRA factor")
        factors[saved] = param
    return factors


def sampler_factors(
    peft_model, adapter: str, dtype: torch.dtype | None = None
) -> list[tuple[str, torch.Tensor]]:
    """(saved name, detached copy) of each factor, lora_B scaled by its layer's alpha/r,
    so that the engine's update of the base weight is exactly B @ A."""
    out = []
    for name, param in adapter_factors(peft_model, adapter).items():
        tensor = param.detach()
        if name.endswith(".lora_B.weight"):
            layer = peft_model.get_submodule(name.rsplit(".", 2)[0])
            tensor = tensor * float(layer.scaling[adapter])
        out.append((name, tensor.to(dtype or tensor.dtype, copy=True)))
    return out


@torch.no_grad()
def load_adapter(peft_model, adapter: str, tensors: dict[str, torch.Tensor]):
    """Copy the saved factors in `tensors` into `adapter`'s parameters (in place, so an
    optimizer keeps them); its factors by saved name."""
    factors = adapter_factors(peft_model, adapter)
    for name, param in factors.items():
        saved = tensors.get(name)
        if saved is None:
            raise TinkerUserError(STATE_FIELD, f"the saved state has no tensor {name!r}")
        if tuple(saved.shape) != tuple(param.shape):
            raise TinkerUserError(
                STATE_FIELD,
                f"the saved {name!r} has shape {tuple(saved.shape)}, the model's "
                f"{tuple(param.shape)}",
            )
        param.copy_(saved)
    return factors


def optimizer_tensors(
    optimizer: torch.optim.Optimizer, factors: dict[str, torch.nn.Parameter]
) -> dict[str, torch.Tensor]:
    """`optimizer.<saved name>.<key>` -> a copy of each tensor of each factor's state."""
    out = {}
    for name, param in factors.items():
        for key, value in optimizer.state.get(param, {}).items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"optimizer state {key!r} of {name!r} is not a tensor")
            out[f"{OPTIMIZER_PREFIX}{name}.{key}"] = value.detach().clone()
    return out


def load_optimizer(
    optimizer: torch.optim.Optimizer,
    factors: dict[str, torch.nn.Parameter],
    tensors: dict[str, torch.Tensor],
) -> None:
    """Load the moments `optimizer_tensors` saved into a fresh `optimizer` over `factors`
    (through `load_state_dict`, which places and casts them as the optimizer needs)."""
    index = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            index[id(param)] = len(index)
    state = {}
    for name, param in factors.items():
        prefix = f"{OPTIMIZER_PREFIX}{name}."
        entry = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
        if entry:
            state[index[id(param)]] = entry
    saved = optimizer.state_dict()
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def gradient_tensors(factors: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """`gradient.<saved name>` -> a copy of each factor's pending gradient (none for a
    factor without one)."""
    return {
        f"{GRADIENT_PREFIX}{name}": param.grad.detach().clone()
        for name, param in factors.items()
        if param.grad is not None
    }


def load_gradients(factors: dict[str, torch.nn.Parameter], tensors: dict[str, torch.Tensor]):
    """Give each factor the pending gradient `gradient_tensors` saved for it (a factor
    without one is left with none)."""
    for name, param in factors.items():
        saved = tensors.get(f"{GRADIENT_PREFIX}{name}")
        param.grad = None if saved is None else saved.to(param.device, param.dtype)
