"""What each part of the pipeline costs, and how long completions are: the planner's inputs.

The costs are a few linear laws, few enough to fit from one run's `metrics.jsonl`
(`calibrate.py`) or to write by hand from a device's data sheet (`load_cost_model`):

- a decode step of an engine running `B` sequences with `C` context tokens in all
  takes `decode_base_s + decode_per_seq_s * B + decode_per_ctx_s * C`;
- a prompt's prefill takes `prefill_per_token_s` per prompt token;
- an optimizer step on `N` tokens takes `train_base_s + N * train_per_token_s / speedup(ranks)`,
  where each doubling of the ranks keeps `rank_efficiency` of its ideal speed-up;
- a weight sync keeps the trainer `sync_transfer_s` (or `model_bytes / sync_bytes_per_s`)
  plus the engine's pause, `pause_s`, during which the engine generates nothing;
- a layout with a log-prob pass (`Deployment.logprob_pass`: the trainer recomputes the
  batch's old log-probs before its update) adds `logprob_per_token_s` per token;
- a colocated layout (one device pool that generates, then trains) spends `switch_s`
  per step moving the pool between the engine's and the trainer's memory, in place of
  the weight transfer.

Or they follow from a data sheet (`datasheet.py`, a `device:` mapping in the YAML).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from asyncgrpo.plan.errors import PlanInputError


@dataclass(frozen=True)
class Costs:
    decode_base_s: float
    decode_per_seq_s: float
    train_per_token_s: float
    decode_per_ctx_s: float = 0.0
    prefill_per_token_s: float = 0.0
    train_base_s: float = 0.0
    rank_efficiency: float = 0.9
    sync_transfer_s: float = 0.0
    pause_s: float = 0.0
    step_overhead_s: float = 0.0  # trainer time per step outside train and sync (logging, ...)
    logprob_per_token_s: float = 0.0  # one rank's forward pass for old log-probs, per token
    switch_s: float = 0.0  # colocated: engine <-> trainer memory switch per step

    def decode_step_s(self, batch: int, context_tokens: float) -> float:
        return (
            self.decode_base_s
            + self.decode_per_seq_s * batch
            + self.decode_per_ctx_s * context_tokens
        )

    def rank_speedup(self, ranks: int) -> float:
        return ranks * self.rank_efficiency ** math.log2(ranks) if ranks > 1 else 1.0

    def train_step_s(self, tokens: int, ranks: int, logprob_pass: bool = False) -> float:
        per_token = self.train_per_token_s + (self.logprob_per_token_s if logprob_pass else 0.0)
        return self.train_base_s + tokens * per_token / self.rank_speedup(ranks)


@dataclass(frozen=True)
class Lengths:
    """Completion lengths (tokens) to draw from, and the prompt's length."""

    completions: tuple[int, ...]
    prompt_tokens: int = 64
    weights: tuple[float, ...] = field(default=())

    def sampler(self, rng: np.random.Generator):
        values = np.asarray(self.completions, dtype=np.int64)
        p = np.asarray(self.weights, dtype=float) if self.weights else None
        p = None if p is None else p / p.sum()
        return lambda n: np.maximum(1, rng.choice(values, size=n, p=p))

    @classmethod
    def constant(cls, tokens: int, prompt_tokens: int = 64) -> Lengths:
        return cls((tokens,), prompt_tokens)

    @classmethod
    def lognormal(cls, median: int, sigma: float, max_tokens: int, prompt_tokens: int = 64):
        """A long-tailed law cut at `max_tokens` (truncated completions pile up there),
        as a fixed table of 2000 quantiles so that every seed sees the same law."""
        q = (np.arange(2000) + 0.5) / 2000
        from statistics import NormalDist

        z = np.array([NormalDist().inv_cdf(x) for x in q])
        values = np.minimum(max_tokens, np.maximum(1, np.round(median * np.exp(sigma * z))))
        return cls(tuple(int(v) for v in values), prompt_tokens)


def costs_from_mapping(spec: dict) -> Costs:
    """A `Costs` from a YAML mapping: either the fields themselves or device figures.

    Device figures: `decode_tokens_per_s` at `decode_batch` (and `decode_latency_s`, the
    step time of one sequence; default: a tenth of the step at `decode_batch`),
    `train_tokens_per_s` (one rank), and `sync_s` or `model_gb` with `sync_gb_per_s`.
    Or a data sheet under `device:` (`datasheet.py`). Fields given directly win.
    """
    from asyncgrpo.plan.datasheet import costs_from_device

    spec = dict(spec)
    known = {f.name for f in fields(Costs)}
    out = {k: float(v) for k, v in spec.items() if k in known}
    device = spec.pop("device", None)
    if "decode_tokens_per_s" in spec:
        batch = int(spec.get("decode_batch", 1))
        step = batch / float(spec["decode_tokens_per_s"])
        base = float(spec.get("decode_latency_s", step / 10))
        per_seq = max(0.0, (step - base) / max(batch - 1, 1))
        out.setdefault("decode_base_s", base - per_seq if batch > 1 else step)
        out.setdefault("decode_per_seq_s", per_seq if batch > 1 else 0.0)
    if "train_tokens_per_s" in spec:
        out.setdefault("train_per_token_s", 1.0 / float(spec["train_tokens_per_s"]))
    if "sync_s" in spec:
        out.setdefault("sync_transfer_s", float(spec["sync_s"]))
    elif "model_gb" in spec and "sync_gb_per_s" in spec:
        out.setdefault("sync_transfer_s", float(spec["model_gb"]) / float(spec["sync_gb_per_s"]))
    if device is not None:  # after the figures above: what is given directly wins
        if not isinstance(device, dict):
            raise PlanInputError("cost model: device is a mapping of data-sheet figures")
        for key, value in costs_from_device(device).items():
            out.setdefault(key, value)
    missing = {"decode_base_s", "decode_per_seq_s", "train_per_token_s"} - out.keys()
    unknown = set(spec) - known - {
        "decode_tokens_per_s", "decode_batch", "decode_latency_s", "train_tokens_per_s",
        "sync_s", "model_gb", "sync_gb_per_s", "lengths",
    }  # fmt: skip
    if unknown:
        raise PlanInputError(f"cost model: unknown field(s) {sorted(unknown)}")
    if missing:
        raise PlanInputError(
            f"cost model: give {sorted(missing)} or decode_tokens_per_s / train_tokens_per_s"
        )
    return Costs(**out)


def lengths_from_mapping(spec: dict | None) -> Lengths:
    """`{constant: N}`, `{median: N, sigma: S, max_tokens: M}` or an empirical law
    `{values: [...], weights: [...]}` (weights optional), with `prompt_tokens`."""
    spec = dict(spec or {"median": 256, "sigma": 0.8, "max_tokens": 1024})
    prompt = int(spec.get("prompt_tokens", 64))
    if "constant" in spec:
        return Lengths.constant(int(spec["constant"]), prompt)
    if "values" in spec:
        values = tuple(int(v) for v in spec["values"])
        weights = tuple(float(w) for w in spec.get("weights", ()))
        if not values or min(values) < 1 or (weights and len(weights) != len(values)):
            raise PlanInputError("lengths: values are positive token counts, one weight each")
        return Lengths(values, prompt, weights)
    try:
        return Lengths.lognormal(
            int(spec["median"]), float(spec["sigma"]), int(spec["max_tokens"]), prompt
        )
    except KeyError as exc:
        raise PlanInputError(f"lengths: missing {exc.args[0]!r}") from None


def load_cost_model(path: Path) -> tuple[Costs, Lengths]:
    import yaml

    try:
        spec = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise PlanInputError(f"cannot read the cost model {path}: {exc}") from None
    if not isinstance(spec, dict):
        raise PlanInputError(f"{path}: a cost model is a mapping of fields")
    return costs_from_mapping({k: v for k, v in spec.items() if k != "lengths"}), (
        lengths_from_mapping(spec.get("lengths"))
    )
