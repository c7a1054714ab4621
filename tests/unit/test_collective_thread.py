"""Collectives run only on the thread that joined the trainer's process group (one issued
from another thread can deadlock the ranks): each wrapper that issues one refuses a
background thread before it communicates, so no process group is needed here. That the
real paths run on the right thread is shown by the 2-rank tests in
tests/integration/test_data_parallel.py, which pass through them.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from asyncgrpo.learning.trainer import distributed
from asyncgrpo.learning.trainer.data_parallel import Channel, DataParallelTrainer, serve
from asyncgrpo.learning.trainer.distributed import (
    World,
    all_reduce_gradients,
    broadcast_parameters,
    require_collective_thread,
)
from asyncgrpo.learning.trainer.sharded import full, shard_trainer


class Shard(torch.Tensor):
    """Stands in for a DTensor: `full` gathers what has `full_tensor`."""

    def full_tensor(self):
        raise AssertionError("gathered off the collective thread")


def _world(size: int = 2) -> World:
    return World(0, size, dist.HashStore(), timeout_s=1.0)


WRAPPERS = {
    "all_reduce_gradients": lambda: all_reduce_gradients([torch.nn.Parameter(torch.ones(2))], 2),
    "broadcast_parameters": lambda: broadcast_parameters(torch.nn.Linear(2, 2)),
    "full": lambda: full(torch.ones(2).as_subclass(Shard)),
    "shard_trainer": lambda: shard_trainer(None, 2),
    "DataParallelTrainer._collective": lambda: DataParallelTrainer(
        None, _world(), "ddp"
    )._collective(lambda: pytest.fail("ran off the collective thread")),
    "serve": lambda: serve(None, _world(), sharded=False),
}


def _raised_on_a_thread(call) -> BaseException | None:
    raised = []

    def target():
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            raised.append(exc)

    thread = threading.Thread(target=target, name="background")
    thread.start()
    thread.join(10)
    return raised[0] if raised else None


@pytest.mark.parametrize("name", WRAPPERS)
def test_a_collective_wrapper_refuses_a_background_thread(name):
    exc = _raised_on_a_thread(WRAPPERS[name])
    assert isinstance(exc, RuntimeError), exc
    message = str(exc)
    assert "is a collective and must run on thread 'MainThread'" in message
    assert "not on 'background'" in message


def test_the_thread_that_joined_the_group_owns_the_collectives(monkeypatch):
    """A run started on another thread (the API from a notebook thread) keeps working
    there; then the main thread is the one refused."""
    owner = threading.Thread(target=lambda: None, name="trainer")
    monkeypatch.setattr(distributed, "_collective_thread", owner)
    with pytest.raises(RuntimeError, match="must run on thread 'trainer'.*not on 'MainThread'"):
        require_collective_thread("the gradient all-reduce")


def test_the_main_thread_passes_and_plain_tensors_need_no_gather():
    require_collective_thread("anything")
    plain = torch.ones(3)
    assert _raised_on_a_thread(lambda: full(plain)) is None  # one process: no collective


def test_rank_0_names_the_ranks_that_did_not_finish_the_last_command():
    world = _world(size=3)
    channel = Channel(world)
    channel.post([{"op": "step"}] * 2)
    channel.post([{"op": "step"}] * 2)
    world.store.set("finished/1", "1")  # rank 1 carried out both commands
    world.store.set("finished/2", "0")  # rank 2 hangs in the second
    assert channel.unfinished() == [2]
