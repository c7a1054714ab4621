"""One simulated engine: continuous batching in segments of decode steps.

The real scheduler (`engine/scheduler.py`) runs one step at a time: admit waiting
requests up to `max_num_seqs` and prefill them, then one decode step for every
running sequence. Simulating each step would cost millions of events for a
cluster-sized plan, so this engine runs a *segment*: the steps until the next
sequence finishes, with the batch fixed and the context growing by the batch each
step, its duration summed in closed form. Anything that would change the batch
(a new request, a pause) cuts the segment at the end of the step in progress, as
the real scheduler would see it at its next step. A request's tokens carry the
engine's version of the step that sampled its first token (its oldest token).
Its times are the simulator's work clock: wall seconds, or on a shared host the work
seconds of `host.py`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from asyncgrpo.plan.costs import Costs


@dataclass
class Sequence:
    group: object  # the simulator's group: the sequence reports to it when it finishes
    length: int  # completion tokens it will generate
    prompt: int
    done: int = 0
    version: int = -1  # engine version of its first token


class SimEngine:
    def __init__(self, index: int, costs: Costs, max_num_seqs: int):
        self.index = index
        self.costs = costs
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.version = 0
        self.epoch = 0  # bumps when the pending segment end is replaced
        self.hold = False  # wait-mode sync: admit nothing, let the running ones finish
        self.paused_until = 0.0
        self.reprefill = False  # abort-mode sync: running requests prefill their context again
        self.generated = 0  # tokens decoded so far
        self.busy: list[tuple[float, float]] = []  # wall spans of segments (the simulator's)
        self._segment: tuple[float, float, int, float, int] | None = None  # t0, prefill, B, C, k

    @property
    def outstanding(self) -> int:
        return len(self.waiting) + len(self.running)

    def idle(self) -> bool:
        return self._segment is None

    def _step_s(self, batch: int, ctx: float, i: int) -> float:
        """The `i`-th step (0-based) of a segment that began with context `ctx`."""
        return self.costs.decode_step_s(batch, ctx + i * batch)

    def _elapsed(self, prefill: float, batch: int, ctx: float, steps: int) -> float:
        c = self.costs.decode_per_ctx_s
        base = self.costs.decode_base_s + self.costs.decode_per_seq_s * batch + c * ctx
        return prefill + steps * base + c * batch * steps * (steps - 1) / 2

    def start(self, now: float) -> float | None:
        """Admit what fits and start the next segment at `now`; its end, or None if idle."""
        prefill_tokens = 0
        if self.reprefill:
            prefill_tokens += sum(s.prompt + s.done for s in self.running)
            self.reprefill = False
        while self.waiting and not self.hold and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            seq.version = self.version
            prefill_tokens += seq.prompt
            self.running.append(seq)
        if not self.running:
            self._segment = None
            return None
        batch = len(self.running)
        ctx = float(sum(s.prompt + s.done for s in self.running))
        steps = min(s.length - s.done for s in self.running)
        prefill = prefill_tokens * self.costs.prefill_per_token_s
        self._segment = (now, prefill, batch, ctx, steps)
        self.epoch += 1
        return now + self._elapsed(prefill, batch, ctx, steps)

    def cut(self, now: float) -> float | None:
        """End the segment with the step running at `now`; the new end (None: unchanged)."""
        if self._segment is None:
            return None
        t0, prefill, batch, ctx, steps = self._segment
        j, t = 0, t0 + prefill
        while j < steps and t <= now:  # steps finished by now, plus the one in progress
            t += self._step_s(batch, ctx, j)
            j += 1
        j = max(j, 1)
        if j >= steps:
            return None
        self._segment = (t0, prefill, batch, ctx, j)
        self.epoch += 1
        return t0 + self._elapsed(prefill, batch, ctx, j)

    def finish_segment(self) -> list[Sequence]:
        """Apply the segment's tokens at its end; the sequences that finished."""
        steps = self._segment[4]
        self._segment = None
        self.generated += steps * len(self.running)
        for seq in self.running:
            seq.done += steps
        finished = [s for s in self.running if s.done >= s.length]
        self.running = [s for s in self.running if s.done < s.length]
        return finished
