"""Rank 0 drives, the other ranks follow: data-parallel steps without background collectives.

Rank 0 is the whole run (engine, orchestrator, buffer, metrics, checkpoints); its
`DataParallelTrainer` is the run's `Trainer`. For each optimizer step it computes the
advantages over the whole batch, shares the groups out by tokens (`distributed.share`)
and posts each rank its share through the store; then every rank, on its main thread,
runs its micro-batches and joins the one gradient all-reduce, and all take the same
optimizer step. The other ranks only ever wait for the next command (`serve`), so no
collective runs on a background thread (`require_collective_thread` refuses one) and
none waits while rank 0 waits for a batch.

Every rank holds the same weights and optimizer state, so rank 0 alone publishes
weights and writes checkpoints (the format of one process, which therefore resumes on
any number of ranks); a resume tells each rank which checkpoint to read.

A rank that dies is noticed before the next command (rank 0 started it and polls it)
or in the all-reduce (gloo reports the closed connection). A rank that hangs is noticed
when a collective or a reply waits past `trainer.collective_timeout_s`; rank 0 then
names the ranks that did not finish the last command. Either way rank 0 raises
`TrainerFailed`, the run stops without a checkpoint of the broken step, and `--resume`
continues from the last one. Ranks waiting for a command leave when rank 0's store goes
away.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from asyncgrpo.learning.rollout.types import Group
from asyncgrpo.learning.trainer.batch import Prepared, StepTotals
from asyncgrpo.learning.trainer.checkpoint import TrainingState, checkpoint_tensors
from asyncgrpo.learning.trainer.distributed import (
    TrainerFailed,
    World,
    all_reduce_gradients,
    broadcast_flag,
    broadcast_parameters,
    decode,
    encode,
    leave,
    require_collective_thread,
    share,
    stop_spawned,
)
from asyncgrpo.learning.trainer.policy_trainer import PolicyTrainer
from asyncgrpo.learning.trainer.sharded import full, shard_trainer

logger = logging.getLogger(__name__)

POLL_S = 2.0  # a waiting rank looks for its next command (and for rank 0) this often


class Channel:
    """Numbered commands from rank 0 to each other rank, and their replies, in the store."""

    def __init__(self, world: World):
        self.world = world
        self.sent = 0
        self.received = 0

    def post(self, messages: list[dict]) -> int:
        """`messages[r - 1]` to rank r; the command's number."""
        number = self.sent
        for rank, message in enumerate(messages, start=1):
            self.world.store.set(f"cmd/{number}/{rank}", encode(message))
        self.sent += 1
        return number

    def replies(self, number: int) -> list[dict]:
        """Each other rank's reply to command `number` (waits up to the collective timeout)."""
        keys = [f"reply/{number}/{rank}" for rank in range(1, self.world.size)]
        deadline = time.monotonic() + self.world.timeout_s
        while True:  # in short waits: a rank killed meanwhile never replies, and the
            try:  # store (served here) would not notice it before the timeout
                wait_s = max(0.01, min(POLL_S, deadline - time.monotonic()))
                self.world.store.wait(keys, timedelta(seconds=wait_s))
                break
            except dist.DistStoreError:
                if self.world.dead_rank() or time.monotonic() >= deadline:
                    raise
        answers = [decode(self.world.store.get(key)) for key in keys]
        for key in keys:
            self.world.store.delete_key(key)
        return answers

    def receive(self) -> tuple[int, dict]:
        """The next command for this rank (blocks; raises when rank 0's store is gone)."""
        key = f"cmd/{self.received}/{self.world.rank}"
        while True:
            try:
                self.world.store.wait([key], timedelta(seconds=POLL_S))
                break
            except dist.DistStoreError:  # a wait timeout: rank 0 is busy elsewhere
                continue
        message = decode(self.world.store.get(key))
        self.world.store.delete_key(key)
        number, self.received = self.received, self.received + 1
        return number, message

    def reply(self, number: int, message: dict) -> None:
        self.world.store.set(f"reply/{number}/{self.world.rank}", encode(message))

    def finished(self, number: int) -> None:
        """This rank carried out command `number` (`unfinished` on rank 0 reads it)."""
        self.world.store.set(f"finished/{self.world.rank}", str(number))

    def unfinished(self) -> list[int]:
        """The ranks that have not carried out the last command posted (they hang, or
        wait in a collective with one that does)."""
        ranks = []
        for rank in range(1, self.world.size):
            key = f"finished/{rank}"
            done = int(self.world.store.get(key)) if self.world.store.check([key]) else -1
            if done < self.sent - 1:
                ranks.append(rank)
        return ranks


class DataParallelTrainer:
    """The run's `Trainer` on rank 0 of a data-parallel trainer (see the module docstring)."""

    def __init__(self, core: PolicyTrainer, world: World, strategy: str):
        self.core = core
        self.world = world
        self.sharded = strategy == "fsdp"
        self.gathers_weights = self.sharded
        self.channel = Channel(world)
        self.failed = False

    def start(self) -> None:
        """The first collectives: rank 0's weights to every rank, then sharding."""
        self._collective(lambda: set_up_rank(self.core, self.world, self.sharded))

    @property
    def version(self) -> int:
        return self.core.version

    def step(self, groups: list[Group]) -> dict[str, float]:
        start = time.perf_counter()
        batch = self.core.prepare(groups)
        shares = share(batch.group_tokens(), self.world.size)
        if self.sharded:  # every rank runs as many forwards as the busiest one
            batch.micro_batches = max(len(self.core.plan(batch.subset(s))) for s in shares)
        number = self._post([{"op": "step", **batch.message(s)} for s in shares[1:]])
        own = batch.subset(shares[0])
        totals = self._collective(lambda: self.core.accumulate(own))
        grad_norm = self._collective(self.core.optim_step)
        for reply in self._collective(lambda: self.channel.replies(number)):
            totals.merge(StepTotals.from_dict(reply))
        return self.core.step_metrics(batch, totals, grad_norm, time.perf_counter() - start)

    def named_weights(self, dtype=None):
        if not self.sharded:  # every rank holds the same weights
            return self.core.named_weights(dtype)
        self._post([{"op": "gather", "dtype": str(dtype)}] * (self.world.size - 1))
        return iter(self._collective(lambda: gather_weights(self.core, dtype)))

    def save_checkpoint(self, directory: Path, state: TrainingState) -> Path:
        if self.sharded:  # the other ranks gather with rank 0 while it writes
            self._post([{"op": "save"}] * (self.world.size - 1))
        return self._collective(lambda: self.core.save_checkpoint(directory, state))

    def load_checkpoint(self, path: Path) -> TrainingState:
        number = self._post([{"op": "load", "path": str(path)}] * (self.world.size - 1))
        state = self.core.load_checkpoint(path)
        self._collective(lambda: self.channel.replies(number))
        return state

    def close(self) -> None:
        """Tell the other ranks to stop (when they can still hear it), then leave."""
        if not self.failed and self.world.dead_rank() is None:
            try:
                self.channel.post([{"op": "stop"}] * (self.world.size - 1))
            except dist.DistError:
                pass
        stop_spawned(self.world, grace_s=0.0 if self.failed else 10.0)
        leave(self.world)

    def _post(self, messages: list[dict]) -> int:
        dead = self.world.dead_rank()
        if dead:
            self._fail(dead)
        return self.channel.post(messages)

    def _collective(self, work):
        require_collective_thread("a data-parallel trainer step")
        try:
            return work()
        except dist.DistError as exc:
            self._fail(self._failure(exc))
        except RuntimeError as exc:  # gloo reports a lost peer as a plain RuntimeError
            if "gloo" not in str(exc).lower() and "connection" not in str(exc).lower():
                raise
            self._fail(self._failure(exc))

    def _failure(self, exc: Exception) -> str:
        """Why a collective failed: a rank that exited, else (a timeout) the ranks that
        did not finish the last command."""
        dead = self.world.dead_rank(wait_s=5.0)
        if dead:
            return dead
        if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
            return f"a trainer rank failed: {exc}"
        try:
            stuck = self.channel.unfinished()
        except dist.DistError:
            stuck = []
        who = ", ".join(f"trainer rank {rank}" for rank in stuck) or "a trainer rank"
        return (
            f"{who} did not finish its work within trainer.collective_timeout_s "
            f"({self.world.timeout_s:g} s) and did not exit: it hangs or is stopped ({exc})"
        )

    def _fail(self, reason: str):
        self.failed = True
        raise TrainerFailed(
            f"{reason}; the job stops here: `asyncgrpo train --resume {self.world.run_dir}` "
            "continues from the last checkpoint"
        )


def set_up_rank(core: PolicyTrainer, world: World, sharded: bool) -> None:
    """On every rank: start from rank 0's weights, then shard (fsdp) or average
    gradients after backward (ddp)."""
    broadcast_parameters(core.model)
    if core.reference is not None and core.reference.scope is None:  # a frozen copy
        broadcast_parameters(core.reference.model)
    if core.device.type == "cpu":  # a timed matmul chose it: ranks must not disagree
        core.bf16_autocast = broadcast_flag(core.bf16_autocast)
    core.dp_world_size = world.size
    if sharded:
        shard_trainer(core, world.size)
    else:
        core.gradient_sync = lambda params: all_reduce_gradients(params, world.size)


def gather_weights(core: PolicyTrainer, dtype) -> list:
    """The published weights, whole (every rank of a sharded trainer runs it in step)."""
    return [(name, full(tensor)) for name, tensor in core.named_weights(dtype)]


def serve(core: PolicyTrainer, world: World, sharded: bool) -> None:
    """Ranks 1..N-1: carry out rank 0's commands until told to stop."""
    require_collective_thread("a trainer rank's command loop")
    channel = Channel(world)
    set_up_rank(core, world, sharded)
    while True:
        number, message = channel.receive()
        op = message["op"]
        if op == "stop":
            return
        if op == "step":
            totals = core.accumulate(Prepared.from_message(message))
            core.optim_step()
            channel.reply(number, totals.as_dict())
        elif op == "load":
            core.load_checkpoint(Path(message["path"]))
            channel.reply(number, {})
        elif op == "gather":
            gather_weights(core, _dtype(message["dtype"]))
        elif op == "save":
            checkpoint_tensors(core.model, core.optimizer)
        else:
            raise ValueError(f"unknown trainer command {op!r}")
        channel.finished(number)


def _dtype(name: str):
    import torch

    return None if name == "None" else getattr(torch, name.removeprefix("torch."))
