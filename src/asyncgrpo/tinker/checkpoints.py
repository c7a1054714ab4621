"""`tinker://` paths as files under `tinker-serve --state-dir`.

`save_state` / `save_weights` write `tinker://<model_id>/weights/<name>`: the adapter's
factors and Adam moments (safetensors) plus its `lora_config`, step count and base model
(JSON), so `load_weights` and `create_training_client_from_state[_with_optimizer]` resume
exactly, in this server or a later one. A named `save_weights_for_sampler` writes
`tinker://<model_id>/sampler_weights/<name>`: the adapter in the engine's sync format, so a
sampler can be created from the path after a restart. Nothing is pickled; a path's parts
are checked before they touch the file system.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from asyncgrpo.tinker.errors import TinkerUserError
from asyncgrpo.tinker.training import ModelState

SCHEME = "tinker://"
KINDS = ("weights", "sampler_weights")
_SAFE = re.compile(r"^[A-Za-z0-9._:=+-]{1,200}$")  # model ids (`s:train:0`) and names
TENSORS, META = "tensors.safetensors", "state.json"


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"{SCHEME}{model_id}/{kind}/{name}"


def parse_path(path: str, field: str = "path") -> tuple[str, str, str]:
    """(model_id, kind, name) of a `tinker://<model_id>/<kind>/<name>` path."""
    parts = path.removeprefix(SCHEME).split("/") if path.startswith(SCHEME) else []
    if len(parts) != 3 or parts[1] not in KINDS:
        raise TinkerUserError(
            field, f"{path!r} is not a tinker://<model_id>/{{weights|sampler_weights}}/<name> path"
        )
    check_name(parts[0], field)
    check_name(parts[2], field)
    return parts[0], parts[1], parts[2]


def check_name(name: str, field: str = "path") -> str:
    if not _SAFE.match(name) or name in (".", ".."):
        raise TinkerUserError(
            field, f"{name!r}: names are 1-200 letters, digits and . _ : = + - (no slashes)"
        )
    return name


class CheckpointStore:
    """Reads and writes `tinker://` paths under one directory."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def directory(self, path: str) -> Path:
        model_id, kind, name = parse_path(path)
        return self.root / model_id.replace(":", "_") / kind / name

    def save_state(self, path: str, state: ModelState, base_model: str) -> str:
        target = self._fresh(path)
        save_file({k: t.contiguous() for k, t in state.tensors.items()}, target / TENSORS)
        meta = {"spec": state.spec, "meta": state.meta, "base_model": base_model}
        (target / META).write_text(json.dumps(meta, indent=2))
        return path

    def load_state(self, path: str) -> tuple[ModelState, str]:
        """The saved state and its base model's name."""
        source = self._existing(path, "weights")
        meta = json.loads((source / META).read_text())
        state = ModelState(meta["spec"], load_file(source / TENSORS), meta["meta"])
        return state, meta["base_model"]

    def save_sampler(self, path: str, weights: list[tuple[str, torch.Tensor]]) -> str:
        target = self._fresh(path)
        save_file({name: t.contiguous() for name, t in weights}, target / TENSORS)
        return path

    def load_sampler(self, path: str) -> list[tuple[str, torch.Tensor]]:
        return list(load_file(self._existing(path, "sampler_weights") / TENSORS).items())

    def exists(self, path: str) -> bool:
        return (self.directory(path) / TENSORS).is_file()

    def size_bytes(self, path: str) -> int:
        """What the files of a saved path take on disk."""
        return sum(f.stat().st_size for f in self.directory(path).iterdir() if f.is_file())

    def saved_spec(self, path: str) -> tuple[dict, str]:
        """A saved state's `lora_config` and base model, without reading its tensors."""
        meta = json.loads((self._existing(path, "weights") / META).read_text())
        return meta["spec"], meta["base_model"]

    def delete(self, path: str) -> bool:
        """Remove a saved path's files; whether there were any."""
        target = self.directory(path)
        if not target.is_dir():
            return False
        shutil.rmtree(target)
        return True

    def _fresh(self, path: str) -> Path:
        target = self.directory(path)
        target.mkdir(parents=True, exist_ok=True)
        return target

    def _existing(self, path: str, kind: str) -> Path:
        if parse_path(path)[1] != kind:
            raise TinkerUserError("path", f"{path!r} is not a {kind} path")
        source = self.directory(path)
        if not (source / TENSORS).is_file():
            raise TinkerUserError("path", f"nothing is saved at {path!r}")
        return source
