"""Assemble a `TinkerService`: its database, the base model for training, the engine for
sampling."""

from __future__ import annotations

from pathlib import Path

import torch

from asyncgrpo.base.config import EmbeddedEngineConfig, TrainerConfig
from asyncgrpo.base.hardware import keep_freed_memory
from asyncgrpo.inference.adapters import ADAPTER_PREFIX, LORA_A_SUFFIX, LORA_B_SUFFIX
from asyncgrpo.tinker.limits import TinkerLimits
from asyncgrpo.tinker.service import ServedModel, TinkerService
from asyncgrpo.tinker.sessions import DEFAULT_TTL_S
from asyncgrpo.tinker.store import TinkerStore


def build_service(
    name: str,
    model_dir: Path,
    engine_cfg: EmbeddedEngineConfig,
    state_dir: Path,
    limits: TinkerLimits | None = None,
    session_ttl_s: float = DEFAULT_TTL_S,
    database: str | None = None,
) -> TinkerService:
    """The service over `model_dir`; its engine process starts loading at once. It trains
    on this process's CPU, which keeps freed memory for reuse (`keep_freed_memory`).
    `session_ttl_s`: how long a session lives without a word from its client; `database`:
    a SQLAlchemy URL (default: SQLite under `state_dir`), opened first, so that one it
    cannot use (`database.DatabaseError`) stops the start before any model loads."""
    store = TinkerStore.open(database, Path(state_dir))
    try:
        return _assemble(name, model_dir, engine_cfg, state_dir, limits, session_ttl_s, store)
    except BaseException:
        store.close()
        raise


def _assemble(name, model_dir, engine_cfg, state_dir, limits, session_ttl_s, store):
    """The base model, the engine (launched) and the service over them."""
    from transformers import AutoModelForCausalLM

    from asyncgrpo.inference.backend.embedded import EmbeddedBackend
    from asyncgrpo.tinker.training import LoraModels

    keep_freed_memory()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    backend = EmbeddedBackend(engine_cfg)
    backend.launch()  # the engine loads while this process builds the trainer
    config = base.config
    served = ServedModel(
        name=name,
        directory=str(Path(model_dir).resolve()),
        vocab_size=int(config.vocab_size),
        max_length=int(getattr(config, "max_position_embeddings", 2048)),
    )
    bf16 = {"bfloat16": True, "float32": False}.get(engine_cfg.dtype, "auto")
    models = LoraModels(base, TrainerConfig(bf16_autocast=bf16))
    return TinkerService(
        served,
        models,
        backend,
        limits or TinkerLimits(),
        zero_adapter(base),
        state_dir,
        store,
        session_ttl_s,
    )


def zero_adapter(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A rank-1 adapter with B = 0 on the first linear layer: syncing it returns every
    weight of the engine to the base (the engine restores what an adapter does not name)."""
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module_name.endswith("q_proj"):
            prefix = ADAPTER_PREFIX + module_name
            return [
                (prefix + LORA_A_SUFFIX, torch.zeros(1, module.in_features)),
                (prefix + LORA_B_SUFFIX, torch.zeros(module.out_features, 1)),
            ]
    raise ValueError("the model has no attention q_proj layer to anchor a base adapter on")
