"""The trainer's process group: who the ranks are, how they meet, how gradients are summed.

Data parallelism here is replicated: every rank holds the whole model and optimizer,
trains on its share of the step's groups, and one bucketed all-reduce averages the
gradients before the (identical) optimizer step. That is DDP's arithmetic without
DDP's wrapper, which cannot be used as is: the packed forward (`packing.py`) calls the
base model and the chunked LM head directly, not the wrapped module, so DDP's reducer
would never be armed. Without hooks no collective runs inside forward or backward, so
ranks may run different numbers of micro-batches, and a rank without groups simply
contributes zeros.

The ranks meet through a `TCPStore` hosted by rank 0 (or by torchrun's agent). Besides
the process group it carries rank 0's commands to the other ranks (`data_parallel.py`): plain
JSON bytes, never pickle. gloo runs it on CPU, NCCL on GPU; the code is the same.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from asyncgrpo.base.ports import free_port

BUCKET_BYTES = 32 << 20  # gradients are all-reduced this many bytes at a time
READY_POLL_S = 0.5

_collective_thread: threading.Thread | None = None  # the thread that joined the group


class TrainerFailed(RuntimeError):
    """A trainer rank died, hung past the collective timeout, or could not start."""


@dataclass
class World:
    rank: int
    size: int
    store: dist.Store
    timeout_s: float
    run_dir: Path | None = None  # rank 0's, for messages
    procs: list = field(default_factory=list)  # ranks rank 0 started: Popen or alike
    logs: list[Path] = field(default_factory=list)

    def dead_rank(self, wait_s: float = 0.0) -> str | None:
        """'rank N exited with code C' for a started rank that is gone, else None.
        `wait_s`: after a failed collective, give a dying rank that long to be reaped."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None:
                    return f"trainer rank {rank} exited with code {proc.returncode}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def log_tail(self, rank: int, lines: int = 5) -> str:
        if rank - 1 >= len(self.logs) or not self.logs[rank - 1].exists():
            return ""
        tail = self.logs[rank - 1].read_text(errors="replace").strip().splitlines()[-lines:]
        return " | ".join(tail)


def launched_rank() -> tuple[int, int] | None:
    """(rank, world size) when a launcher (torchrun, accelerate) started several ranks."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    return (int(os.environ.get("RANK", "0")), size) if size > 1 else None


def _backend(device: str) -> str:
    """NCCL for weights on a GPU, gloo for weights on the CPU (`trainer.device`)."""
    return "nccl" if device == "cuda" else "gloo"


def _store(host: str, port: int, size: int, is_master: bool, timeout_s: float) -> dist.Store:
    return dist.TCPStore(
        host,
        port,
        size,
        is_master=is_master,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def _join(store: dist.Store, rank: int, size: int, timeout_s: float) -> None:
    device = dist.PrefixStore("asyncgrpo", store).get("device").decode()
    dist.init_process_group(
        _backend(device),
        store=dist.PrefixStore("pg", store),
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
    )
    global _collective_thread
    _collective_thread = threading.current_thread()


def require_collective_thread(what: str) -> None:
    """Raise unless this is the thread that joined the process group (the main thread
    before one is joined). Every rank must issue its collectives in one order, from one
    thread: one on a background thread can deadlock the ranks."""
    owner = _collective_thread or threading.main_thread()
    here = threading.current_thread()
    if here is not owner:
        raise RuntimeError(
            f"{what} is a collective and must run on thread {owner.name!r}, which joined "
            f"the trainer's process group, not on {here.name!r}: a collective on a "
            "background thread can deadlock the ranks"
        )


def start_world(
    size: int,
    run_dir: Path,
    model_dir: str,
    param: torch.Tensor,
    timeout_s: float,
    spawn: Callable[[World, str, int], None] | None = None,
    host: str = "127.0.0.1",
) -> World:
    """Rank 0: start ranks 1..size-1 (or meet a launcher's), wait until each has loaded
    its model, and join the process group. They load `model_dir` in the dtype of rank 0's
    `param`; its device picks the backend. `spawn(world, host, port)` starts the ranks
    (default: child processes here) and adds a `Popen`-like handle per rank to
    `world.procs`; `host` is the address they reach rank 0's store at."""
    launched = launched_rank()
    if launched is not None:
        size = launched[1]
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        # torchrun's agent hosts a store on MASTER_PORT; the workers are its clients
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = _store(host, port, size, not agent_store, timeout_s)
        world = World(0, size, dist.PrefixStore("asyncgrpo", store), timeout_s, run_dir)
    else:
        port = free_port(host)
        store = _store(host, port, size, True, timeout_s)
        world = World(0, size, dist.PrefixStore("asyncgrpo", store), timeout_s, run_dir)
        (spawn or _spawn)(world, host, port)
    world.store.set("model_dir", model_dir)
    world.store.set("dtype", str(param.dtype).removeprefix("torch."))
    world.store.set("device", param.device.type)
    try:
        _wait_for_ranks(world)
        _join(store, 0, size, timeout_s)
    except BaseException:
        stop_spawned(world)
        raise
    return world


def join_world(timeout_s: float) -> World:
    """Ranks 1..N-1: connect to rank 0's store (from the launcher's environment)."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = _store(host, port, size, False, timeout_s)
    return World(rank, size, dist.PrefixStore("asyncgrpo", store), timeout_s)


def announce_ready(world: World) -> None:
    """A rank's model is loaded: rank 0 may form the process group."""
    world.store.set(f"ready/{world.rank}", "1")
    _join(_base_store(world), world.rank, world.size, world.timeout_s)


def announce_failure(world: World, message: str) -> None:
    world.store.set(f"failed/{world.rank}", message)


def _base_store(world: World) -> dist.Store:
    return world.store.underlying_store


def _wait_for_ranks(world: World) -> None:
    """Until every rank said ready; a rank that failed or exited meanwhile ends the wait."""
    deadline = time.monotonic() + world.timeout_s
    for rank in range(1, world.size):
        while not world.store.check([f"ready/{rank}"]):
            if world.store.check([f"failed/{rank}"]):
                reason = world.store.get(f"failed/{rank}").decode()
                raise TrainerFailed(f"trainer rank {rank} could not start: {reason}")
            dead = world.dead_rank()
            if dead:
                raise TrainerFailed(f"{dead} before joining | {world.log_tail(rank)}")
            if time.monotonic() > deadline:
                raise TrainerFailed(
                    f"trainer rank {rank} did not start within {world.timeout_s:g} s "
                    "(trainer.collective_timeout_s)"
                )
            time.sleep(READY_POLL_S)


def _spawn(world: World, host: str, port: int) -> None:
    """Ranks 1..N-1 as child processes of this one, logging to the run directory."""
    run_dir = world.run_dir
    for rank in range(1, world.size):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world.size),
            "MASTER_ADDR": host,
            "MASTER_PORT": str(port),
        }
        log = Path(run_dir) / f"trainer-rank{rank}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "asyncgrpo.learning.trainer.follower", str(run_dir)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        world.procs.append(proc)
        world.logs.append(log)


def _die_with_parent() -> None:
    """In the child: SIGKILL when rank 0 dies (even by kill -9), no orphaned rank."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def stop_spawned(world: World, grace_s: float = 10.0) -> None:
    """Wait for the ranks rank 0 started to exit (they were told to stop), then kill."""
    deadline = time.monotonic() + grace_s
    for proc in world.procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def leave(world: World) -> None:
    global _collective_thread
    if dist.is_initialized():
        dist.destroy_process_group()
    _collective_thread = None


def all_reduce_gradients(params: list[torch.nn.Parameter], size: int) -> None:
    """Average the gradients of `params` over the ranks, in buckets of `BUCKET_BYTES`.
    A parameter without a gradient on this rank contributes zeros."""
    require_collective_thread("the gradient all-reduce")
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    for bucket in _buckets(grads):
        flat = torch._utils._flatten_dense_tensors(bucket)
        dist.all_reduce(flat)
        flat /= size
        for grad, reduced in zip(
            bucket, torch._utils._unflatten_dense_tensors(flat, bucket), strict=True
        ):
            grad.copy_(reduced)


def all_gather_values(values: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D `values` (their counts may differ), concatenated in rank order, on
    every rank. Under NCCL `values` must sit on this rank's GPU."""
    require_collective_thread("gathering values over the ranks")
    size = dist.get_world_size()
    count = torch.tensor([values.numel()], dtype=torch.int64, device=values.device)
    counts = [torch.zeros_like(count) for _ in range(size)]
    dist.all_gather(counts, count)
    sizes = [int(c) for c in counts]
    if max(sizes) == 0:
        return values
    padded = torch.zeros(max(sizes), dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded)
    return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if buckets[-1] and (size + nbytes > BUCKET_BYTES or t.dtype != buckets[-1][0].dtype):
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return [b for b in buckets if b]


def broadcast_parameters(model: torch.nn.Module) -> None:
    """Every rank starts from rank 0's weights (a LoRA adapter's random init included)."""
    require_collective_thread("the parameter broadcast")
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor.data, src=0)


def broadcast_flag(flag: bool) -> bool:
    """Rank 0's `flag` on every rank (a CPU process group: gloo)."""
    require_collective_thread("the flag broadcast")
    tensor = torch.tensor([int(flag)])
    dist.broadcast(tensor, src=0)
    return bool(tensor.item())


def share(groups_tokens: list[int], size: int) -> list[list[int]]:
    """Split groups (by index, with their token counts) over `size` ranks: largest first,
    each to the rank with the fewest tokens so far. A group stays whole."""
    loads = [0] * size
    shares: list[list[int]] = [[] for _ in range(size)]
    for index in sorted(range(len(groups_tokens)), key=lambda i: -groups_tokens[i]):
        rank = loads.index(min(loads))
        shares[rank].append(index)
        loads[rank] += groups_tokens[index]
    return [sorted(s) for s in shares]


def encode(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def decode(data: bytes) -> dict:
    return json.loads(data)
