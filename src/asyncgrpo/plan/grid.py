"""A grid of candidate layouts, their predictions, and the fastest within a device budget."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

from asyncgrpo.plan.costs import Costs, Lengths
from asyncgrpo.plan.predict import predict
from asyncgrpo.plan.simulate import Deployment, Prediction

AXES = (
    "engines",
    "trainer_ranks",
    "max_staleness",
    "max_ahead_batches",
    "batch_groups",
    "num_generations",
    "sync_mode",
)


@dataclass
class Candidate:
    layout: Deployment
    devices: int
    prediction: Prediction

    def row(self) -> dict:
        p = self.prediction
        return {
            **{k: getattr(self.layout, k) for k in AXES},
            "colocated": self.layout.colocated,
            "logprob_pass": self.layout.logprob_pass,
            "shared_cores": self.layout.shared_cores,
            "devices": self.devices,
            "samples_per_s": p.samples_per_s,
            "step_s": p.step_s,
            "engine_idle": p.engine_idle,
            "trainer_idle": p.trainer_idle,
            "staleness": {str(k): v for k, v in p.staleness.items()},
            "dropped_stale": p.dropped_stale,
        }


def layouts(base: Deployment, axes: dict[str, list]) -> list[Deployment]:
    """Every combination of the values in `axes` (missing axes keep `base`'s value);
    a layout the recipe would refuse (a sync less often than the staleness allows) or a
    colocated one with staleness is left out."""
    names = [k for k in AXES if axes.get(k)]
    out = []
    for values in itertools.product(*(axes[k] for k in names)):
        layout = Deployment(**{**asdict(base), **dict(zip(names, values, strict=True))})
        if layout.colocated and layout.max_staleness:
            continue  # a colocated pool cannot generate while it trains
        if layout.weight_sync_steps <= layout.max_staleness + 1:
            out.append(layout)
    return out


def devices(layout: Deployment, gpus_per_engine: int) -> int:
    """Devices the layout holds: colocated engines and ranks share theirs."""
    engines = layout.engines * gpus_per_engine
    if layout.colocated:
        return max(engines, layout.trainer_ranks)
    return engines + layout.trainer_ranks


def evaluate(
    candidates: list[Deployment],
    costs: Costs,
    lengths: Lengths,
    *,
    gpus_per_engine: int = 1,
    seed: int = 0,
    steps: int = 40,
) -> list[Candidate]:
    return [
        Candidate(
            layout,
            devices(layout, gpus_per_engine),
            predict(layout, costs, lengths, seed=seed, steps=steps, warmup=max(1, steps // 5)),
        )
        for layout in candidates
    ]


def fastest(candidates: list[Candidate], budget: int | None) -> Candidate | None:
    fits = [c for c in candidates if budget is None or c.devices <= budget]
    return max(fits, key=lambda c: c.prediction.samples_per_s, default=None)


def table(candidates: list[Candidate]) -> str:
    head = (
        f"{'eng':>3} {'rank':>4} {'stale':>5} {'ahead':>5} {'bg':>3} {'G':>3} {'mode':>5} "
        f"{'dev':>4} {'samples/s':>10} {'step s':>8} {'eng idle':>8} {'trn idle':>8}  staleness"
    )
    lines = [head]
    for c in candidates:
        lay, p = c.layout, c.prediction
        ahead = "-" if lay.max_ahead_batches is None else f"{lay.max_ahead_batches:g}"
        dist = " ".join(f"{k}:{v}" for k, v in p.staleness.items())
        mode = "coloc" if lay.colocated else lay.sync_mode
        lines.append(
            f"{lay.engines:>3} {lay.trainer_ranks:>4} {lay.max_staleness:>5} {ahead:>5} "
            f"{lay.batch_groups:>3} {lay.num_generations:>3} {mode:>5} {c.devices:>4} "
            f"{p.samples_per_s:>10.3f} {p.step_s:>8.3f} {p.engine_idle:>8.2f} "
            f"{p.trainer_idle:>8.2f}  {dist}"
        )
    return "\n".join(lines)
