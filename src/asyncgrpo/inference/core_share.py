"""Lend the engine's idle cores to the trainer when both run on one CPU machine.

On a CPU the embedded engine and the trainer split the cores (`engine.num_threads`,
`trainer.num_threads`), and the trainer bounds every step: on 2 cores with the default
recipe the engine computes ~45% of the time and its core idles the rest, while the
trainer runs ~1.5x faster on both cores. Giving the trainer both cores for good does not
work: while the engine decodes, three OpenMP threads on two cores wait on each other at
every op (measured: no faster than one trainer thread).

So the engine publishes one byte, "computing now", in a small shared file, and the
trainer reads it before each decoder layer's forward and backward: while the engine is
idle the trainer runs `wide` threads (its own plus the engine's), else `narrow` (its
own). A switch costs nothing measurable (`torch.set_num_threads` between ops); the
engine waits at most one layer's work for its core back. `trainer.borrow_engine_threads`
turns it off.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
import weakref
from pathlib import Path

import torch

from asyncgrpo.inference.transport.shm import shm_directory

BUSY_FILE_ENV = "ASYNCGRPO_ENGINE_BUSY_FILE"
_PREFIX = "asyncgrpo-busy-"

logger = logging.getLogger(__name__)


class BusyFlag:
    """One shared byte: 1 while the engine computes. The engine writes, the trainer reads."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 1)

    @classmethod
    def create(cls) -> BusyFlag:
        """A fresh flag (idle), removed when it is garbage or the interpreter exits."""
        fd, path = tempfile.mkstemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=shm_directory())
        os.write(fd, b"\0")
        os.close(fd)
        flag = cls(path)
        weakref.finalize(flag, flag.path.unlink, missing_ok=True)
        return flag

    @classmethod
    def from_env(cls) -> BusyFlag | Unshared:
        """In the engine: the flag of the trainer that started it, else one nobody reads."""
        path = os.environ.get(BUSY_FILE_ENV)
        if not path:
            return Unshared()
        try:
            return cls(path)
        except (OSError, ValueError):
            return Unshared()  # gone or never written: the engine computes as usual

    def set(self, busy: bool) -> None:
        self._map[0] = 1 if busy else 0

    @property
    def busy(self) -> bool:
        return self._map[0] == 1


class Unshared:
    """An engine's flag where no trainer borrows: setting it does nothing."""

    busy = False

    def set(self, busy: bool) -> None:
        pass


class ThreadLender:
    """Sets the trainer's torch threads before every decoder layer's forward and backward
    from the engine's flag (module docstring)."""

    def __init__(self, flag: BusyFlag, narrow: int, wide: int):
        self.flag, self.narrow, self.wide = flag, narrow, wide
        self._handles: list = []

    def adjust(self) -> None:
        want = self.narrow if self.flag.busy else self.wide
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

    def install(self, model: torch.nn.Module) -> int:
        """Hook every decoder layer of an HF model; returns how many (0: none found, and
        nothing changes)."""
        layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
        for layer in layers:
            self._handles.append(layer.register_forward_pre_hook(self._before_forward))
            self._handles.append(layer.register_forward_hook(self._after_forward))
        return len(layers)

    def remove(self) -> None:
        """Take the hooks off and give the trainer back its own threads."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        torch.set_num_threads(self.narrow)

    def _before_forward(self, module, args) -> None:
        self.adjust()

    def _after_forward(self, module, args, output) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(self._before_backward)  # runs as this layer's backward starts

    def _before_backward(self, grad: torch.Tensor) -> None:
        self.adjust()


def may_borrow(cfg) -> bool:
    """Whether a run of `cfg` (a `RunConfig`) can lend its engine's threads to the trainer:
    one trainer process beside one embedded engine process this run starts here. The
    trainer's device is checked once it is known (`lend_to`)."""
    engine = cfg.engine
    return (
        cfg.trainer.borrow_engine_threads is not False
        and cfg.cluster.launcher == "local"
        and engine.type == "embedded"
        and engine.replica_count == 1
        and engine.upstream_url is None
        and cfg.trainer.num_processes == 1
        and "WORLD_SIZE" not in os.environ  # not a torchrun rank
    )


def share_engine_cores(cfg, engine) -> BusyFlag | None:
    """Before `engine` (a backend) launches: a flag its child process will publish to,
    where a run of `cfg` may borrow (`may_borrow`); None elsewhere."""
    process = getattr(engine, "process", None)
    if not may_borrow(cfg) or not isinstance(getattr(process, "extra_env", None), dict):
        return None
    flag = BusyFlag.create()
    process.extra_env[BUSY_FILE_ENV] = str(flag.path)
    return flag


def lend_to(trainer, flag: BusyFlag | None, cfg) -> ThreadLender | None:
    """Install the lender on a CPU trainer's model; None where it does not apply (no
    `flag`: `share_engine_cores` found no engine to share with)."""
    device = getattr(trainer, "device", None)
    if flag is None or device is None or device.type != "cpu":
        return None
    narrow = cfg.trainer.num_threads
    wide = min(narrow + (cfg.engine.num_threads or 1), os.cpu_count() or narrow)
    if wide <= narrow:
        return None
    lender = ThreadLender(flag, narrow, wide)
    if not lender.install(trainer.model):
        return None
    logger.info("the trainer borrows the engine's threads while it idles (%d -> %d)", narrow, wide)
    return lender
