"""The discrete-event run: an orchestrator admitting groups, engines, a trainer, syncs.

It follows asyncgrpo's own rules, with its pure functions where they exist:
admission is `base/staleness.py`'s `may_admit` (the staleness budget and the
`max_ahead` look-ahead cap), a batch drops groups `is_too_stale` at consume time, a
group of `num_generations` sequences goes to the replica with the least outstanding
sequences (`client/router.py`), the trainer syncs every `weight_sync_steps` steps and
waits for the sync, and the engine pauses under `keep` (a pause), `abort` (a pause,
then running requests prefill their context again) or `wait` (no new admissions until
the running ones finish, then the pause). Synchronous GRPO is `max_staleness = 0`.

A `colocated` layout is the synchronous baseline of verl-style systems: one device pool
whose engines generate a batch, then whose trainer ranks train on it (the same devices),
with `Costs.switch_s` per step to move the pool between the two (offload, reload,
reshard) in place of a weight transfer. Only `max_staleness = 0` is colocated here: the
pool cannot generate while it trains.

A layout with `shared_cores` puts the engines and the trainer on one host's cores
(`host.py`): their computation runs in work seconds of one shared clock, and every
change in the number of busy threads moves the wall-clock ends of what is running.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from asyncgrpo.base.staleness import admission_budget, is_too_stale, may_admit
from asyncgrpo.plan.costs import Costs, Lengths, PlanInputError
from asyncgrpo.plan.engine import Sequence, SimEngine
from asyncgrpo.plan.host import WorkClock


@dataclass(frozen=True)
class Deployment:
    """One candidate configuration (the recipe's names where it has them)."""

    engines: int = 1
    trainer_ranks: int = 1
    max_staleness: int = 1
    max_ahead_batches: float | None = 1.0
    batch_groups: int = 4
    num_generations: int = 8
    sync_mode: str = "keep"
    weight_sync_steps: int = 1
    max_num_seqs: int = 256
    colocated: bool = False  # engines and trainer take turns on one device pool
    logprob_pass: bool = False  # the trainer recomputes old log-probs before its update
    shared_cores: float | None = None  # engines and trainer share these cores (one host)
    engine_threads: int = 1  # threads of one replica, with shared_cores
    trainer_threads: int = 1  # threads of one trainer rank, with shared_cores

    @property
    def max_ahead(self) -> int | None:
        a = self.max_ahead_batches
        return None if a is None else math.ceil(a * self.batch_groups)


@dataclass
class SimGroup:
    sequences: list[Sequence]
    pending: int

    @property
    def min_version(self) -> int:
        return min(s.version for s in self.sequences)

    @property
    def tokens(self) -> int:
        return sum(s.prompt + s.length for s in self.sequences)


@dataclass
class Prediction:
    samples_per_s: float
    step_s: float
    engine_idle: float
    trainer_idle: float
    staleness: dict[int, int]
    dropped_stale: int
    timeline: list[tuple[str, float, float]] = field(default_factory=list)


class TraceRecorder:
    """Checks the throttle's bound after every event and keeps the in-flight trace."""

    def __init__(self):
        self.points: list[tuple[float, int, int]] = []  # (time, queued + in flight, bound)

    def check(self, now: float, held: int, budget: int, max_ahead: int | None) -> None:
        bound = budget if max_ahead is None else min(budget, max_ahead)
        self.points.append((now, held, bound))
        if held > bound:
            raise AssertionError(f"t={now:.3f}: {held} groups queued or in flight > {bound}")


class Simulation:
    def __init__(self, layout: Deployment, costs: Costs, lengths: Lengths, seed: int = 0):
        if layout.colocated and layout.max_staleness != 0:
            raise PlanInputError("a colocated layout is synchronous: it needs max_staleness 0")
        self.layout, self.costs, self.lengths = layout, costs, lengths
        self.draw = lengths.sampler(np.random.default_rng(seed))
        self.engines = [SimEngine(i, costs, layout.max_num_seqs) for i in range(layout.engines)]
        self.events: list = []
        self.counter = 0
        self.queue: deque[SimGroup] = deque()
        self.in_flight = self.consumed = self.version = self.engine_version = 0
        self.turn = 0  # round-robin among replicas tied on outstanding work
        self.trainer_busy = False  # training or syncing
        self.training = False
        self.trainer_epoch = 0  # bumps when the pending end of a step is replaced
        self.train_started = self.train_end = 0.0  # wall, work seconds
        self.clock = None if layout.shared_cores is None else WorkClock(layout.shared_cores)
        self.segment_started = [0.0] * layout.engines  # wall
        self.segment_end = [0.0] * layout.engines  # work seconds
        self.step_ends: list[float] = []
        self.staleness: list[int] = []
        self.dropped_stale = 0
        self.syncing: dict | None = None
        self.spans: list[tuple[str, float, float]] = []

    def push(self, t: float, kind: str, *data) -> None:
        self.counter += 1
        heapq.heappush(self.events, (t, self.counter, kind, data))

    # ---- orchestrator ---------------------------------------------------------------
    def admit(self, now: float) -> None:
        lay = self.layout
        touched: dict[int, SimEngine] = {}
        while may_admit(
            engine_version=self.engine_version,
            max_staleness=lay.max_staleness,
            batch_groups=lay.batch_groups,
            consumed=self.consumed,
            queued=len(self.queue),
            in_flight=self.in_flight,
            max_ahead=lay.max_ahead,
        ):
            self.in_flight += 1
            prompt = self.lengths.prompt_tokens
            lengths = self.draw(lay.num_generations)
            group = SimGroup([], lay.num_generations)
            group.sequences = [Sequence(group, int(n), prompt) for n in lengths]
            engine = self.route()
            engine.waiting.extend(group.sequences)
            touched[engine.index] = engine
        for engine in touched.values():  # after the loop: groups admitted together start together
            self.wake(engine, now)

    def route(self) -> SimEngine:
        least = min(e.outstanding for e in self.engines)
        n = len(self.engines)
        tied = [e for e in self.engines if e.outstanding == least]
        choice = min(tied, key=lambda e: (e.index - self.turn) % n)
        self.turn = (choice.index + 1) % n
        return choice

    def wake(self, engine: SimEngine, now: float) -> None:
        if now < engine.paused_until:
            return  # its resume event starts it
        was_idle = engine.idle()
        end = engine.start(self.work(now)) if was_idle else engine.cut(self.work(now))
        if end is not None:
            if was_idle:
                self.segment_started[engine.index] = now
            self.schedule_segment(engine, end, now)

    # ---- the host's clock (`host.py`): the identity unless the roles share cores --------
    def work(self, now: float) -> float:
        return now if self.clock is None else self.clock.work(now)

    def wall(self, now: float, work_end: float) -> float:
        return work_end if self.clock is None else self.clock.wall(now, work_end)

    def schedule_segment(self, engine: SimEngine, work_end: float, now: float) -> None:
        self.segment_end[engine.index] = work_end
        self.push(self.wall(now, work_end), "segment", engine.index, engine.epoch)

    def schedule_step_end(self, now: float) -> None:
        self.trainer_epoch += 1
        self.push(self.wall(now, self.train_end), "trained", self.trainer_epoch)

    def reshare(self, now: float) -> None:
        """After every event: the busy threads set the rate; a new rate moves every end."""
        if self.clock is None:
            return
        lay = self.layout
        busy = sum(not e.idle() for e in self.engines) * lay.engine_threads
        busy += self.training * lay.trainer_ranks * lay.trainer_threads
        if not self.clock.share(now, busy):
            return
        for engine in self.engines:
            if not engine.idle():
                engine.epoch += 1
                self.schedule_segment(engine, self.segment_end[engine.index], now)
        if self.training:
            self.schedule_step_end(now)

    # ---- events -----------------------------------------------------------------------
    def on_segment(self, now: float, index: int, epoch: int) -> None:
        engine = self.engines[index]
        if epoch != engine.epoch or engine.idle():
            return
        engine.busy.append((self.segment_started[index], now))
        for seq in engine.finish_segment():
            seq.group.pending -= 1
            if seq.group.pending == 0:
                self.in_flight -= 1
                self.queue.append(seq.group)
        if self.syncing is not None and self.syncing.get("pause_at") is not None:
            self.begin_pause(engine, now)
        else:
            self.wake(engine, now)
        self.try_train(now)

    def try_train(self, now: float) -> None:
        if self.trainer_busy:
            return
        lay = self.layout
        kept = deque(
            g
            for g in self.queue
            if not is_too_stale(self.version, g.min_version, lay.max_staleness)
        )
        self.dropped_stale += len(self.queue) - len(kept)
        if len(kept) < len(self.queue):  # dropped groups free their quota at once
            self.queue = kept
            self.admit(now)
        if len(self.queue) < lay.batch_groups:
            return
        batch = [self.queue.popleft() for _ in range(lay.batch_groups)]
        self.consumed += lay.batch_groups
        self.staleness.extend(self.version - g.min_version for g in batch)
        self.trainer_busy = self.training = True
        tokens = sum(g.tokens for g in batch)
        took = self.costs.step_overhead_s + self.costs.train_step_s(
            tokens, lay.trainer_ranks, lay.logprob_pass
        )
        self.train_started, self.train_end = now, self.work(now) + took
        self.schedule_step_end(now)
        self.admit(now)

    def on_trained(self, now: float, epoch: int) -> None:
        if epoch != self.trainer_epoch:
            return  # moved by a change in the host's sharing
        self.training = False
        # as the run's timeline counts it, the trainer is busy training or syncing; its
        # other per-step work (the row, samples, checkpoints) counts as idle
        self.spans.append(("train", self.train_started + self.costs.step_overhead_s, now))
        self.version += 1
        self.step_ends.append(now)
        if self.version % self.layout.weight_sync_steps:
            self.trainer_idle(now)
            return
        self.syncing = {"start": now, "pause_at": None, "paused": set()}
        if self.layout.sync_mode == "wait":
            for engine in self.engines:
                engine.hold = True
        transfer = self.costs.switch_s if self.layout.colocated else self.costs.sync_transfer_s
        self.push(now + transfer, "transferred")

    def on_transferred(self, now: float) -> None:
        self.syncing["pause_at"] = now
        for engine in self.engines:
            if self.layout.sync_mode == "wait" and engine.running:
                continue  # pauses once its running requests finish (on_segment)
            if engine.idle():
                self.begin_pause(engine, now)
            else:
                end = engine.cut(self.work(now))
                if end is not None:
                    self.schedule_segment(engine, end, now)

    def begin_pause(self, engine: SimEngine, now: float) -> None:
        if engine.index in self.syncing["paused"]:
            self.wake(engine, now)
            return
        if self.layout.sync_mode == "wait" and engine.running:
            self.wake(engine, now)
            return
        self.syncing["paused"].add(engine.index)
        engine.paused_until = now + self.costs.pause_s
        self.spans.append((f"pause{engine.index}", now, engine.paused_until))
        self.push(engine.paused_until, "resumed", engine.index)

    def on_resumed(self, now: float, index: int) -> None:
        engine = self.engines[index]
        engine.version, engine.hold = self.version, False
        engine.reprefill = self.layout.sync_mode == "abort" and bool(engine.running)
        self.wake(engine, now)
        if self.syncing is None:  # another replica's resume at the same instant ended it
            return
        if len(self.syncing["paused"]) == len(self.engines) and all(
            e.paused_until <= now for e in self.engines
        ):
            self.spans.append(("sync", self.syncing["start"], now))
            for other in self.engines:  # resumes due at this same instant
                other.version, other.hold = self.version, False
            self.syncing = None
            self.engine_version = self.version
            self.admit(now)
            self.trainer_idle(now)

    def trainer_idle(self, now: float) -> None:
        self.trainer_busy = False
        self.try_train(now)

    # ---- the run --------------------------------------------------------------------
    def run(self, steps: int, recorder: TraceRecorder | None = None) -> None:
        handlers = {
            "segment": self.on_segment,
            "trained": self.on_trained,
            "transferred": self.on_transferred,
            "resumed": self.on_resumed,
        }
        self.admit(0.0)
        self.reshare(0.0)
        while self.events and len(self.step_ends) < steps:
            now, _, kind, data = heapq.heappop(self.events)
            handlers[kind](now, *data)
            self.reshare(now)
            if recorder is not None:
                lay = self.layout
                budget = admission_budget(
                    self.engine_version, lay.max_staleness, lay.batch_groups, self.consumed
                )
                recorder.check(now, len(self.queue) + self.in_flight, budget, lay.max_ahead)
        if len(self.step_ends) < steps:
            raise RuntimeError("the simulated run stalled: no event left before the last step")
