"""Where metrics go: append-only JSON Lines files (always) and optional trackers.

The JSONL files in the run directory are the source of truth: plots, the
benchmark and `--resume` read only them. Each line is flushed as soon as it is
written, so a `kill -9` loses at most the line being written; a torn last line
is repaired (dropped) the next time the file is opened for appending.

TensorBoard, Weights & Biases and Trackio are mirrors selected by
`report_to`. They are imported only when asked for, and a missing package is
one clear error naming the pip extra that provides it.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol


def to_jsonable(value: Any) -> Any:
    """`value` as plain JSON types: NaN/inf -> None, numpy/torch scalars and
    arrays -> Python numbers and lists, mapping keys -> str, unknown -> str."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in value]
    if hasattr(value, "tolist"):  # numpy scalar/array, torch tensor (no import needed)
        return to_jsonable(value.tolist())
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def iter_jsonl(path: str | Path) -> Iterator[dict]:
    """Objects of a JSONL file; a missing file is empty, torn/invalid lines are skipped."""
    path = Path(path)
    if not path.exists():
        return
    with path.open(encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue  # the line a kill -9 tore in half
            if isinstance(obj, dict):
                yield obj


class JsonlWriter:
    """Append-only, line-flushed, thread-safe JSONL file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        _drop_torn_tail(self.path)
        self._file = self.path.open("a", encoding="utf-8")
        self._written = 0  # lines appended by this writer (since open or the last rewrite)

    def write(self, obj: Mapping[str, Any]) -> None:
        line = json.dumps(to_jsonable(obj), allow_nan=False, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()
            self._written += 1

    def rewrite(self, transform: Callable[[list[dict]], list[dict]], *, drop_own=False) -> None:
        """Replace the file's objects by `transform(objects)` (atomic replace).

        `drop_own`: first discard the lines this writer appended since it was opened.
        """
        with self._lock:
            self._file.close()
            rows = list(iter_jsonl(self.path))
            if drop_own and self._written:
                rows = rows[: max(len(rows) - self._written, 0)]
            tmp = self.path.with_suffix(self.path.suffix + ".tmp")
            with tmp.open("w", encoding="utf-8") as f:
                for r in transform(rows):
                    f.write(json.dumps(r, allow_nan=False, separators=(",", ":")) + "\n")
            os.replace(tmp, self.path)
            self._file = self.path.open("a", encoding="utf-8")
            self._written = 0

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line that lacks its newline, so the next append starts clean."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("rb+") as f:
        end = f.seek(0, os.SEEK_END)
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return
        pos = end
        while pos > 0:  # scan back, 64 KiB at a time, for the last complete line
            start = max(0, pos - 65536)
            f.seek(start)
            newline = f.read(pos - start).rfind(b"\n")
            if newline >= 0:
                f.truncate(start + newline + 1)
                return
            pos = start
        f.truncate(0)


# --------------------------------------------------------------------------- mirrors


class Sink(Protocol):
    """A mirror of the scalar metrics (one per `report_to` entry)."""

    def log(self, step: int, metrics: Mapping[str, float], kind: str) -> None:
        """Record flat numeric `metrics` for `step`; `kind` is "train" or "eval"."""

    def close(self) -> None:
        """Flush and release resources."""


def _require(module: str, report_to: str, extra: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"report_to: '{report_to}' needs the '{module}' package: "
            f"pip install 'asyncgrpo[{extra}]'"
        ) from e


class TensorBoardSink:
    def __init__(self, run_dir: Path, **_: Any):
        _require("tensorboard", "tensorboard", "tensorboard")
        writer_cls = importlib.import_module("torch.utils.tensorboard").SummaryWriter
        self._writer = writer_cls(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: Mapping[str, float], kind: str) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(f"{kind}/{key}", value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    def __init__(self, run_dir: Path, project: str, name: str, config: dict | None = None):
        self._wandb = _require("wandb", "wandb", "wandb")
        self._run = self._wandb.init(project=project, name=name, config=config, dir=str(run_dir))

    def log(self, step: int, metrics: Mapping[str, float], kind: str) -> None:
        self._run.log({f"{kind}/{k}": v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self._run.finish()


class TrackioSink:
    def __init__(self, run_dir: Path, project: str, name: str, config: dict | None = None):
        self._trackio = _require("trackio", "trackio", "trackio")
        self._trackio.init(project=project, name=name, config=config)

    def log(self, step: int, metrics: Mapping[str, float], kind: str) -> None:
        self._trackio.log({f"{kind}/{k}": v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self._trackio.finish()


SINKS: dict[str, type] = {
    "tensorboard": TensorBoardSink,
    "wandb": WandbSink,
    "trackio": TrackioSink,
}


def make_sinks(
    report_to: list[str] | tuple[str, ...],
    run_dir: Path,
    *,
    project: str = "asyncgrpo",
    name: str | None = None,
    config: dict | None = None,
) -> list[Sink]:
    """Build the mirrors named in `report_to` (unknown names are a ValueError)."""
    sinks: list[Sink] = []
    for target in report_to:
        if target not in SINKS:
            raise ValueError(f"report_to: unknown sink '{target}'; choose from {sorted(SINKS)}")
        kwargs: dict[str, Any] = {"project": project, "name": name or run_dir.name}
        kwargs["config"] = config
        sinks.append(SINKS[target](run_dir, **kwargs))
    return sinks


def flat_scalars(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of `metrics` as `{"a/b": x}`, skipping None/NaN, strings and lists."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_scalars(value, prefix=name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if math.isfinite(value):
                out[name] = float(value)
    return out
