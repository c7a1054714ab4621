"""Assemble a `TinkerService`: its database, the base model for training, the engine for
sampling (the embedded engine, or with a `VLLMEngineConfig` a vLLM server:
`vllm_sampling.py`)."""

from __future__ import annotations

from pathlib import Path

import torch

from asyncgrpo.base.config import EmbeddedEngineConfig, TrainerConfig, VLLMEngineConfig
from asyncgrpo.base.hardware import keep_freed_memory
from asyncgrpo.inference.adapters import ADAPTER_PREFIX, LORA_A_SUFFIX, LORA_B_SUFFIX
from asyncgrpo.tinker.limits import TinkerLimits
from asyncgrpo.tinker.sampling import EngineWeights
from asyncgrpo.tinker.service import ServedModel, TinkerService
from asyncgrpo.tinker.sessions import DEFAULT_TTL_S
from asyncgrpo.tinker.store import TinkerStore


def build_service(
    name: str,
    model_dir: Path,
    engine_cfg: EmbeddedEngineConfig | VLLMEngineConfig,
    state_dir: Path,
    limits: TinkerLimits | None = None,
    session_ttl_s: float = DEFAULT_TTL_S,
    database: str | None = None,
    max_resident_models: int | None = None,
) -> TinkerService:
    """The service over `model_dir`; its engine process starts loading at once. It trains
    on this process's CPU, which keeps freed memory for reuse (`keep_freed_memory`).
    `session_ttl_s`: how long a session lives without a word from its client; `database`:
    a SQLAlchemy URL (default: SQLite under `state_dir`), opened first, so that one it
    cannot use (`database.DatabaseError`) stops the start before any model loads;
    `max_resident_models`: training models (and sets of sampler weights) kept in memory,
    the least recently used beyond it offloaded to `state_dir` (None: no bound)."""
    store = TinkerStore.open(database, Path(state_dir))
    try:
        return _assemble(
            name,
            model_dir,
            engine_cfg,
            state_dir,
            limits,
            session_ttl_s,
            store,
            max_resident_models,
        )
    except BaseException:
        store.close()
        raise


def _assemble(
    name, model_dir, engine_cfg, state_dir, limits, session_ttl_s, store, max_resident_models=None
):
    """The base model, the engine (launched) and the service over them."""
    from transformers import AutoModelForCausalLM

    from asyncgrpo.tinker.training import LoraModels

    keep_freed_memory()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # the engine loads while this process builds the trainer
    backend, engine, limits = _sampling(engine_cfg, base, Path(state_dir), limits or TinkerLimits())
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
        limits,
        engine,
        state_dir,
        store,
        session_ttl_s,
        max_resident_models,
    )


def _sampling(engine_cfg, base, state_dir: Path, limits: TinkerLimits):
    """The engine's backend (launched), how a sample gets its sampler's weights there, and
    `limits` with the LoRA ranks that engine serves."""
    if isinstance(engine_cfg, VLLMEngineConfig):
        from asyncgrpo.tinker.vllm_sampling import vllm_sampling

        return vllm_sampling(engine_cfg, state_dir, limits)
    from asyncgrpo.inference.backend.embedded import EmbeddedBackend

    backend = EmbeddedBackend(engine_cfg)
    backend.launch()
    base_adapter = zero_adapter(base)
    return backend, EngineWeights(backend, lambda: base_adapter), limits


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
