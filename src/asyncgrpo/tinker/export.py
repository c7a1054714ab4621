"""`asyncgrpo export` of a Tinker saved state: a PEFT adapter or a merged model directory.

`tinker-serve` saves a model (`save_state` / `save_weights`) as
`<state-dir>/<model_id, ':' as '_'>/weights/<name>/`: `tensors.safetensors` (the adapter's
factors under peft's saved names, unscaled, plus `optimizer.*` Adam moments) and
`state.json` (the `lora_config` it was created with, its step count, the base model's
name). That is not something transformers or peft load. Export rebuilds the adapter with
the server's fixed settings (rank from the state, `lora_alpha` 32, no dropout, the target
modules the `train_*` flags name), loads the factors strictly and lets peft write the
adapter, or merges it into the base and writes a full model directory.

Tied heads: Tinker trains `lm_head` by default (`train_unembed`), and small models
(SmolLM2, the test model) tie it to the input embedding. The adapter changes only the
head, as the server's forward applies it; merging into a tied weight would change the
embedding as well. The merged export therefore unties first: the head gets its own copy
of the weight and the config says `tie_word_embeddings: false`.

Sampler checkpoints (`sampler_weights/<name>`) are not exported: they hold the engine's
pre-scaled factors and no `lora_config`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from asyncgrpo.run.export import ExportError, building, check_out_dir, save_full
from asyncgrpo.tinker.checkpoints import META, SCHEME, TENSORS, CheckpointStore
from asyncgrpo.tinker.errors import TinkerUserError
from asyncgrpo.tinker.lora_state import OPTIMIZER_PREFIX, adapter_factors, load_adapter
from asyncgrpo.tinker.training import LORA_ALPHA, LoraSpec

ADAPTER = "default"  # peft's name for the one adapter of an exported model


def tinker_checkpoint(source: str, state_dir: str | Path | None) -> Path | None:
    """The saved state's directory when `source` names one: a `tinker://.../weights/NAME`
    path (looked up under `state_dir`) or such a directory itself (it holds
    `tensors.safetensors` and `state.json`); None for anything else (a run directory)."""
    if source.startswith(SCHEME):
        if state_dir is None:
            raise ExportError(
                f"{source} is a tinker:// path: pass --state-dir, the directory "
                "`asyncgrpo tinker-serve --state-dir` saved it under"
            )
        try:
            directory = CheckpointStore(Path(state_dir)).directory(source)
        except TinkerUserError as exc:
            raise ExportError(str(exc)) from None
        if directory.parent.name == "sampler_weights":
            raise ExportError(
                f"{source} is a sampler checkpoint, which keeps no lora_config; export the "
                "path that save_state (or save_weights) returned"
            )
        if not (directory / META).is_file():
            raise ExportError(f"nothing is saved at {source} under {state_dir} ({directory})")
        return directory
    path = Path(source)
    if (path / TENSORS).is_file() and (path / META).is_file():
        return path
    return None


def export_tinker_state(checkpoint_dir: str | Path, out_dir: str | Path, merged: bool) -> str:
    """Write the saved state in `checkpoint_dir` to `out_dir`; says what."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    spec, base_name = read_meta(checkpoint_dir)
    check_out_dir(out_dir)
    base_dir = base_model_dir(base_name)
    model = adapted_model(base_dir, spec, load_file(checkpoint_dir / TENSORS), untie=merged)
    with building(out_dir) as target:
        if merged:
            save_full(model.merge_and_unload(), base_dir, target)
            kind = "merged model (base + LoRA adapter)"
        else:
            # the adapter alone: peft's "auto" would add the tied embedding's weight
            model.save_pretrained(target, save_embedding_layers=False)
            kind = f"LoRA adapter for {base_dir}"
    return f"Tinker state {checkpoint_dir} as a {kind} written to {out_dir}"


def read_meta(checkpoint_dir: Path) -> tuple[LoraSpec, str]:
    """(the model's lora_config, its base model's name) from `state.json`."""
    path = checkpoint_dir / META
    try:
        meta = json.loads(path.read_text())
        return LoraSpec(**meta["spec"]), str(meta["base_model"])
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ExportError(f"{path} is not a Tinker saved state: {exc!r}") from None


def base_model_dir(name: str) -> Path:
    """The local directory of the base model the server trained on."""
    from asyncgrpo.base.models import resolve_model

    try:
        return Path(resolve_model(name)).resolve()
    except ValueError as exc:  # ModelNotFoundError
        raise ExportError(f"cannot find the saved state's base model: {exc}") from None


def adapted_model(base_dir: Path, spec: LoraSpec, tensors: dict[str, torch.Tensor], untie: bool):
    """The base (fp32) wrapped with the state's adapter, its factors loaded; with `untie`,
    an adapted head that shares the input embedding's weight first gets a copy of its own."""
    from transformers import AutoModelForCausalLM

    from asyncgrpo.learning.trainer.lora import import_peft

    peft = import_peft()
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if untie and spec.train_unembed:
        untie_head(base)
    config = peft.LoraConfig(
        r=spec.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=spec.target_modules()
    )
    model = peft.get_peft_model(base, config, adapter_name=ADAPTER)
    factors = {k: t for k, t in tensors.items() if not k.startswith(OPTIMIZER_PREFIX)}
    extra = sorted(set(factors) - set(adapter_factors(model, ADAPTER)))
    try:
        if extra:
            raise TinkerUserError("state", f"tensors the model has no place for: {extra[:3]}")
        load_adapter(model, ADAPTER, factors)
    except TinkerUserError as exc:
        raise ExportError(f"the saved state does not fit {base_dir}: {exc}") from None
    return model


def untie_head(model: torch.nn.Module) -> None:
    """Give the output head its own weight when it shares the input embedding's."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or head.weight is not embedding.weight:
        return
    head.weight = torch.nn.Parameter(head.weight.detach().clone())
    model.config.tie_word_embeddings = False
