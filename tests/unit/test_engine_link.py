"""`EngineLink`'s weight syncs that land in the background, with a fake engine.

- The trainer goes on while a sync is in flight, and what lands is the weights as
  they were when the sync began, under that version, even though the trainer's own
  tensors changed meanwhile; the buffer hears the version only once it landed.
- A tied embedding and head are copied once, into one buffer, reused across syncs.
- A sync that fails for good aborts the run at the next sync, or at `settle`.
- Weights not in host memory (here: on the meta device) are published in place, and
  the sync waits for them to land.
- An evaluation started while a sync lands samples after it (`Evaluator` and `landed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
import torch

from asyncgrpo.base.engine_errors import EngineDied
from asyncgrpo.base.loop_thread import LoopThread
from asyncgrpo.learning.coordinator.buffer import RolloutBuffer
from asyncgrpo.run.evaluation import Evaluator
from asyncgrpo.run.session import RunAborted
from asyncgrpo.run.session.engine_link import EngineLink, WeightSnapshot


class GatedEngine:
    """Records what each sync delivers once `gate` opens; fails while `fail` is set."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.fail = False
        self.landed: list[tuple[int, dict[str, list[float]]]] = []
        self.sync_timings: dict[str, float] = {}
        self.restarts = 0

    async def sync_weights(self, weights, version: int, mode: str) -> None:
        await asyncio.to_thread(self.gate.wait, 10)
        if self.fail:
            raise EngineDied("the engine died three times")
        self.landed.append((version, {name: t.tolist() for name, t in weights}))

    async def revive(self) -> bool:
        return False


class Weights:
    """A trainer's weights and version; `named_weights` hands out its live tensors."""

    gathers_weights = False

    def __init__(self, device: str = "cpu") -> None:
        self.version = 0
        self.w = torch.zeros(3, device=device)
        self.tied = torch.zeros(2, device=device)

    def named_weights(self, dtype=None):
        return iter([("w", self.w), ("embed", self.tied), ("head", self.tied)])

    def step(self) -> None:
        self.version += 1
        self.w += 1
        self.tied += 10


class QuietActivity:
    @contextlib.contextmanager
    def doing(self, what: str, span: str | None = None):
        yield


@pytest.fixture
def link_parts():
    loop = LoopThread()
    engine, trainer = GatedEngine(), Weights()
    buffer = RolloutBuffer(batch_groups=1, max_staleness=1)
    link = EngineLink(engine, loop, trainer, buffer, QuietActivity(), torch.float32, "keep")
    yield link, engine, trainer, buffer
    engine.gate.set()
    loop.stop()


def test_the_trainer_goes_on_while_the_sync_lands_the_weights_it_began_with(link_parts):
    link, engine, trainer, buffer = link_parts
    trainer.step()
    link.sync_weights()  # returns with the gate shut: nothing has landed
    assert engine.landed == [] and buffer.engine_version == 0
    trainer.step()  # the trainer's tensors change under the sync in flight
    engine.gate.set()
    link.settle()
    assert engine.landed == [(1, {"w": [1.0] * 3, "embed": [10.0] * 2, "head": [10.0] * 2})]
    assert buffer.engine_version == 1
    link.sync_weights()
    link.settle()
    assert engine.landed[-1] == (2, {"w": [2.0] * 3, "embed": [20.0] * 2, "head": [20.0] * 2})


def test_tied_tensors_are_copied_once_into_buffers_reused_by_every_sync():
    snapshot, trainer = WeightSnapshot(), Weights()
    first = dict(snapshot.take(trainer.named_weights(), torch.float32))
    assert snapshot.taken
    assert first["embed"] is first["head"] and first["w"] is not trainer.w
    trainer.step()
    second = dict(snapshot.take(trainer.named_weights(), torch.float32))
    assert all(second[name] is first[name] for name in first)
    assert second["head"].tolist() == [10.0, 10.0]


def test_the_snapshot_casts_to_the_engine_dtype_while_it_copies():
    snapshot, trainer = WeightSnapshot(), Weights()
    trainer.w += torch.tensor([1.0, 1 + 2**-10, 3.0])  # 1 + 2^-10 rounds to 1 in bf16
    taken = dict(snapshot.take(trainer.named_weights(), torch.bfloat16))
    assert {t.dtype for t in taken.values()} == {torch.bfloat16}
    assert taken["w"].tolist() == [1.0, 1.0, 3.0]
    assert taken["embed"] is taken["head"]
    assert trainer.w.dtype == torch.float32  # the trainer's own tensors are untouched


class ShardedWeights(Weights):
    """A trainer whose `named_weights` gathers: it is asked for the engine's dtype."""

    gathers_weights = True

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[torch.dtype | None] = []

    def named_weights(self, dtype=None):
        self.asked.append(dtype)
        return iter([("w", self.w.to(dtype))])


def test_a_gathering_trainer_is_asked_for_the_engine_dtype_a_local_one_for_its_own(link_parts):
    link, engine, _, _ = link_parts
    engine.gate.set()
    sharded = link.trainer = ShardedWeights()
    link.weight_dtype = torch.bfloat16
    link.sync_weights()
    link.settle()
    assert sharded.asked == [torch.bfloat16]
    local = link.trainer = ShardedWeights()
    local.gathers_weights = False
    link.sync_weights()
    link.settle()
    assert local.asked == [None]


def test_a_sync_that_fails_for_good_aborts_the_run_at_the_next_sync(link_parts):
    link, engine, trainer, _ = link_parts
    engine.fail = True
    link.sync_weights()
    engine.gate.set()
    with pytest.raises(RunAborted, match="died three times"):
        link.sync_weights()


def test_a_failure_in_flight_is_raised_by_revive_once_it_is_known(link_parts):
    link, engine, _, _ = link_parts
    engine.fail = True
    link.sync_weights()
    link.revive()  # still in flight: the sync revives the engine itself
    engine.gate.set()
    link.loop.run(link.landed())
    with pytest.raises(RunAborted):
        link.revive()


def test_weights_outside_host_memory_are_published_in_place_and_waited_for(link_parts):
    link, engine, _, _ = link_parts
    trainer = link.trainer = Weights(device="meta")
    sent = []

    async def record(weights, version, mode):
        sent.extend(weights)

    engine.sync_weights = record
    link.sync_weights()
    assert not link.snapshot.taken
    assert [t for _, t in sent] == [trainer.w, trainer.tied, trainer.tied]
    assert all(a is b for (_, a), b in zip(sent, [trainer.w, trainer.tied, trainer.tied]))


class Tracker:
    def __init__(self) -> None:
        self.evals: dict[int, dict] = {}

    def has_eval(self, step: int) -> bool:
        return step in self.evals

    def log_eval(self, step: int, result: dict) -> None:
        self.evals[step] = result


class VersionBuilder:
    """Evaluates by reporting the version the engine has landed."""

    def __init__(self, engine: GatedEngine) -> None:
        self.engine = engine

    async def evaluate(self, rows):
        return {"version_seen": self.engine.landed[-1][0] if self.engine.landed else 0}


def test_an_evaluation_begun_while_a_sync_lands_samples_after_it(link_parts):
    link, engine, trainer, _ = link_parts
    tracker = Tracker()
    evaluator = Evaluator(
        VersionBuilder(engine), [{"prompt": "p"}], link.loop, tracker, every=1, landed=link.landed
    )
    trainer.step()
    link.sync_weights()
    evaluator.maybe_start(1)
    threading.Timer(0.2, engine.gate.set).start()
    evaluator.collect(block=True)
    assert tracker.evals[1]["version_seen"] == 1
