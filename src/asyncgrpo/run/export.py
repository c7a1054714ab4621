"""`asyncgrpo export RUN_DIR OUT_DIR`: a run's trained policy as a directory others load.

A run directory keeps the trained weights in the form training needs: checkpoints
(`checkpoints/step-NNNNNN/model.safetensors`, tied aliases stored once; under LoRA only
the adapter, PeftModel `state_dict()` names) and optional weight snapshots
(`weights/step-NNNNNN.safetensors`, what a sync publishes: under LoRA the adapter with
alpha/r baked into lora_B). Neither is a model directory. Export rebuilds the model on
the run's base (`initial_model/`, else `model.name_or_path` of `config.yaml`), loads the
weights into it strictly, and lets transformers / peft write their own formats:

- full fine-tuning: a Hugging Face model directory (config, generation config,
  tokenizer, `model.safetensors`) for `AutoModelForCausalLM.from_pretrained` and
  `asyncgrpo serve --model OUT_DIR`;
- LoRA: a peft adapter directory for `PeftModel.from_pretrained(base, OUT_DIR)`, or
  with `merged=True` the base with the adapter merged in, as a full model directory.

Weights are written in float32, the trainer's dtype. The directory is built beside
OUT_DIR and renamed into place, so a failed export leaves nothing half-written.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file

from asyncgrpo.base.config import ConfigError, RunConfig, load_config
from asyncgrpo.learning.trainer.best import BEST_DIR, WEIGHTS_FILE, read_best

STEP_NAME = re.compile(r"^step-(\d+)(\.safetensors)?$")


class ExportError(Exception):
    """A problem the user can fix (wrong directory, unknown step, ...): one line."""


def export_run(
    run_dir: str | Path,
    out_dir: str | Path,
    step: int | None = None,
    merged: bool = False,
    last: bool = False,
) -> str:
    """Write the run's policy at `step` to `out_dir`; says what. Without `step`: the best
    evaluation's weights where the run kept them (`best/`), else (or with `last`) the newest."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    cfg = load_run_config(run_dir)
    step, weights_path = pick_weights(run_dir, step, last)
    check_out_dir(out_dir)
    base_dir = base_model_dir(run_dir, cfg)
    weights = load_file(weights_path)
    lora = cfg.model.lora
    with building(out_dir) as target:
        if lora is None:
            save_full(full_model(base_dir, weights, weights_path), base_dir, target)
            kind = "model"
        else:
            model = lora_model(base_dir, lora, weights, weights_path)
            if merged:
                save_full(model.merge_and_unload(), base_dir, target)
                kind = "merged model (base + LoRA adapter)"
            else:
                model.save_pretrained(target)
                kind = f"LoRA adapter for {base_dir}"
    return f"step {step} {kind} from {weights_path} written to {out_dir}"


def load_run_config(run_dir: Path) -> RunConfig:
    """The run's `config.yaml`, validated."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ExportError(f"{run_dir} is not a run directory (no config.yaml)")
    try:
        return load_config(path)
    except ConfigError as exc:
        raise ExportError(f"{path}: {exc}".replace("\n", " ")) from None


def available_weights(run_dir: Path) -> dict[int, Path]:
    """step -> weights file: complete checkpoints, and weight snapshots where no
    checkpoint holds that step (a checkpoint keeps the full-precision weights)."""
    found: dict[int, Path] = {}
    for path in sorted((run_dir / "weights").glob("step-*.safetensors")):
        if match := STEP_NAME.match(path.name):
            found[int(match.group(1))] = path
    for path in sorted((run_dir / "checkpoints").glob("step-*")):
        match = STEP_NAME.match(path.name)
        if match and (path / "state.json").is_file() and (path / "model.safetensors").is_file():
            found[int(match.group(1))] = path / "model.safetensors"
    return found


def pick_weights(run_dir: Path, step: int | None, last: bool = False) -> tuple[int, Path]:
    """(step, weights file) of `step`; when None, of the best evaluation (unless `last`),
    else of the newest step."""
    best = read_best(run_dir)
    if step is None and not last and best is not None:
        return int(best["step"]), run_dir / BEST_DIR / WEIGHTS_FILE
    found = available_weights(run_dir)
    if not found:
        raise ExportError(
            f"{run_dir} has no checkpoint (nothing in checkpoints/ or weights/) to export"
        )
    if step is None:
        step = max(found)
    if step not in found:
        steps = ", ".join(str(s) for s in sorted(found))
        raise ExportError(f"{run_dir} has no checkpoint of step {step}; available: {steps}")
    return step, found[step]


def check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir} exists and is not an empty directory")


def base_model_dir(run_dir: Path, cfg: RunConfig) -> Path:
    """The model the run started from: its saved copy, else the configured name."""
    saved = run_dir / "initial_model"
    if (saved / "config.json").is_file():
        return saved
    from asyncgrpo.base.models import resolve_model

    try:
        return Path(resolve_model(cfg.model.name_or_path))
    except ValueError as exc:  # ModelNotFoundError
        raise ExportError(f"cannot find the run's base model: {exc}") from None


def full_model(base_dir: Path, weights: dict[str, torch.Tensor], source: Path):
    """The base architecture holding `weights` (every parameter, tied ones once)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [name for name in missing if not _is_tied_alias(model, name, weights)]
    _require_match(source, missing, unexpected)
    return model


def lora_model(base_dir: Path, lora, weights: dict[str, torch.Tensor], source: Path):
    """The base wrapped with the run's adapter settings, the trained adapter loaded."""
    from transformers import AutoModelForCausalLM

    from asyncgrpo.learning.trainer.lora import apply_lora

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    try:
        model = apply_lora(base, lora)
    except ConfigError as exc:
        raise ExportError(str(exc)) from None
    state = adapter_state_dict(model, weights)
    missing, unexpected = model.load_state_dict(state, strict=False)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    _require_match(source, [m for m in missing if m in trainable], unexpected)
    return model


def adapter_state_dict(model, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors under the PeftModel's `state_dict()` names, scale not baked in.

    Checkpoints already are; published names (snapshots) lack the adapter name and carry
    alpha/r in lora_B (`trainer/lora.py`), which is divided back out here.
    """
    from asyncgrpo.learning.trainer.lora import LORA_SUFFIXES, lora_scaling

    adapter = model.active_adapter
    state = {}
    for name, tensor in weights.items():
        if not name.endswith(LORA_SUFFIXES):  # a checkpoint name, or not the adapter's
            state[name] = tensor
            continue
        stem = name.removesuffix(".weight")
        if name.endswith(".lora_B.weight"):
            tensor = tensor.float() / lora_scaling(model, name)
        state[f"{stem}.{adapter}.weight"] = tensor
    return state


def _is_tied_alias(model, name: str, weights: dict[str, torch.Tensor]) -> bool:
    """True when `name` shares storage with a parameter the weights did provide."""
    state = model.state_dict()
    pointer = state[name].data_ptr()
    return any(state[other].data_ptr() == pointer for other in weights if other in state)


def _require_match(source: Path, missing: list[str], unexpected: list[str]) -> None:
    if missing or unexpected:
        raise ExportError(
            f"{source} does not match the run's model: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]} (was config.yaml edited after the run?)"
        )


def save_full(model, base_dir: Path, target: Path) -> None:
    """A Hugging Face model directory: weights, config, generation config, tokenizer."""
    from transformers import AutoTokenizer

    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(target)


@contextlib.contextmanager
def building(out_dir: Path) -> Iterator[Path]:
    """A fresh directory beside `out_dir`, renamed to `out_dir` when the block succeeds and
    removed when it fails."""
    tmp = out_dir.absolute().parent / f".{out_dir.name}.export-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.is_dir():
        out_dir.rmdir()  # empty: checked before building
    os.replace(tmp, out_dir)
