"""Loading a model into the embedded engine, and checking what may replace its weights.

Both refuse early with an `RequestError` that says what to do: a model whose
architecture the engine cannot run is refused before its weights load (naming the
engine that can), a context limit beyond the model's before any cache is sized, and
a weight update whose names, shapes or dtypes do not fit before anything is copied.
"""

from __future__ import annotations

import torch

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.inference.engine.runner import SUPPORTED_ARCHITECTURES
from asyncgrpo.inference.engine.types import RequestError


def load_model(
    path: str,
    dtype: torch.dtype,
    compute_dtype: torch.dtype,
    device: torch.device | str = "cpu",
):
    """(tokenizer, model): weights rounded to `dtype`, computed in `compute_dtype` on
    `device` (the engine's), frozen."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    check_architecture(AutoConfig.from_pretrained(path).model_type, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = model.to(device=device, dtype=compute_dtype).eval()  # bf16 values are exact in fp32
    model.requires_grad_(False)
    return tokenizer, model


def check_architecture(model_type: str, path: str) -> None:
    """Refuse, before the weights load, a model the embedded engine's forward cannot run."""
    if model_type in SUPPORTED_ARCHITECTURES:
        return
    raise RequestError(
        f"{path}: model_type '{model_type}' is not one the embedded engine runs "
        f"({', '.join(sorted(SUPPORTED_ARCHITECTURES))}). Train it with `engine.type: vllm` "
        "(asyncgrpo launches a vLLM server; docs/vllm.md), or serve it with "
        "vLLM and front that server with `asyncgrpo serve --upstream-url URL`",
        500,
    )


def context_limit(config: EmbeddedEngineConfig, model) -> int:
    """`config.max_model_len`, checked against the model; by default the model's own limit
    (`max_position_embeddings`), capped at 4096 so the default KV cache stays small."""
    limit = int(getattr(model.config, "max_position_embeddings", 4096) or 4096)
    if config.max_model_len and config.max_model_len > limit:
        raise RequestError(
            f"max_model_len={config.max_model_len} exceeds the model's "
            f"max_position_embeddings={limit}: lower engine.max_model_len (--max-model-len) "
            "or leave it unset to use the model's limit",
            500,
        )
    return int(config.max_model_len or min(limit, 4096))


def eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (model.generation_config, model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update(eos if isinstance(eos, list) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def check_update(params: dict[str, torch.Tensor], staged: list[tuple[str, torch.Tensor]]):
    """Raise before anything is copied if a tensor names no parameter, or has the wrong shape
    or dtype.

    Any floating-point dtype may replace a floating-point parameter: it is rounded to the
    engine's weight dtype on copy (fp32 master weights reach a bf16 engine so). Integer or
    bool bytes are never taken for weights: a non-float parameter needs its exact dtype.
    """
    for name, tensor in staged:
        target = params.get(name)
        if target is None:
            raise RequestError(f"unknown parameter '{name}'")
        if tuple(target.shape) != tuple(tensor.shape):
            raise RequestError(
                f"shape mismatch for '{name}': got {tuple(tensor.shape)}, "
                f"expected {tuple(target.shape)}"
            )
        floating = target.is_floating_point()
        if tensor.dtype != target.dtype and not (floating and tensor.is_floating_point()):
            got, held = (str(t.dtype).removeprefix("torch.") for t in (tensor, target))
            raise RequestError(
                f"dtype mismatch for '{name}': got {got}, expected "
                f"{'a floating-point dtype' if floating else held} (the engine holds {held})"
            )


def tied_names(params: dict[str, torch.Tensor]) -> set[str]:
    """Names of parameters that share one tensor with another name (a tied LM head)."""
    holders: dict[int, list[str]] = {}
    for name, tensor in params.items():
        holders.setdefault(id(tensor), []).append(name)
    return {name for names in holders.values() if len(names) > 1 for name in names}
