"""A layout's prediction: the simulated run measured over its steady state."""

from __future__ import annotations

from collections import Counter

from asyncgrpo.plan.costs import Costs, Lengths
from asyncgrpo.plan.simulate import Deployment, Prediction, Simulation, TraceRecorder


def _overlap(spans: list[tuple[float, float]], t0: float, t1: float) -> float:
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in spans)


def predict(
    layout: Deployment,
    costs: Costs,
    lengths: Lengths,
    *,
    seed: int = 0,
    steps: int = 40,
    warmup: int = 8,
    recorder: TraceRecorder | None = None,
) -> Prediction:
    """Simulate `steps` optimizer steps; rates are over the steps after `warmup`."""
    if not 0 <= warmup < steps:
        raise ValueError("need 0 <= warmup < steps")
    sim = Simulation(layout, costs, lengths, seed)
    sim.run(steps, recorder)
    ends = sim.step_ends
    t0 = ends[warmup - 1] if warmup else 0.0
    t1 = ends[steps - 1]
    window = max(t1 - t0, 1e-12)
    measured = steps - warmup
    samples = measured * layout.batch_groups * layout.num_generations
    busy = sum(_overlap(e.busy, t0, t1) for e in sim.engines) / len(sim.engines)
    trainer = [(a, b) for name, a, b in sim.spans if name in ("train", "sync")]
    return Prediction(
        samples_per_s=samples / window,
        step_s=window / measured,
        engine_idle=1.0 - busy / window,
        trainer_idle=1.0 - _overlap(trainer, t0, t1) / window,
        staleness=dict(sorted(Counter(sim.staleness[warmup * layout.batch_groups :]).items())),
        dropped_stale=sim.dropped_stale,
        timeline=sim.spans + [(f"engine{e.index}", a, b) for e in sim.engines for a, b in e.busy],
    )
