"""The run directory's metric record: one JSON line per optimizer step.

Files written under `runs/<name>/` (all JSON Lines, appended and flushed per line):

- `metrics.jsonl` — every line has `"kind"` and `"step"`:
  - `"kind": "train"`: one per optimizer step: `time_s` (seconds of run clock),
    `version`, `reward_mean`, `reward_std`, `staleness_mean`, `staleness_max`,
    `staleness_counts` (`{"0": n, "1": n, ...}`, samples consumed this step by
    staleness — the histogram field), `dropped_stale`, `queue_size`, the overlap
    ratios, throughputs, loss statistics, `reward/<function>` means, ...
  - `"kind": "eval"`: held-out evaluation, `{"step", "time_s", "eval_reward_mean", ...}`.
- `samples.jsonl` — one line per consumed group: `{"step", "group_id" (its prompt-stream position),
  "min_version", "prompt", "samples": [{"completion", "reward", "rewards", ...}]}`
  (see `rows.py`).
- `timeline.jsonl` — role busy intervals (see `timeline.py`).

NaN and inf are written as `null`; numpy and torch scalars become numbers.

Resuming: files are opened for appending, and `truncate_after(step)` drops
lines of steps the checkpoint does not contain. The evaluations kept are
remembered (`has_eval`), so a resumed run does not evaluate the checkpoint's
step a second time. The run clock continues from
the last kept `time_s`, so wall-clock axes measure training time, not downtime.

Aggregation (`aggregate_metrics`) takes the union of keys across rows and
NaN-aware means: keying a batch by its first sample would lose the keys
that sample lacks.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .sinks import JsonlWriter, Sink, flat_scalars, iter_jsonl, make_sinks, to_jsonable
from .timeline import Timeline

METRICS_FILE, SAMPLES_FILE, TIMELINE_FILE = "metrics.jsonl", "samples.jsonl", "timeline.jsonl"
REDUCERS = {
    "mean": lambda xs: sum(xs) / len(xs),
    "sum": sum,
    "max": max,
    "min": min,
}


def _as_number(value: Any) -> float | None:
    """The value as a float (possibly NaN); None for None and non-numbers."""
    if value is None:
        return None
    if hasattr(value, "item"):  # numpy / torch scalar
        value = value.item()
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def aggregate_metrics(
    rows: Iterable[Mapping[str, Any]], reduce: Mapping[str, str] | None = None
) -> dict[str, float]:
    """Combine per-sample (or per-group) metric dicts into one dict.

    Keys are the union over all rows, in first-seen order. Each key's value is
    the mean (or `reduce[key]`: "sum" | "max" | "min") of the rows that carry a
    finite number for it; None and NaN count as missing, not as zero. A key no
    row has a finite value for is NaN (written as null).
    """
    reduce = reduce or {}
    values: dict[str, list[float]] = {}
    for row in rows:
        for key, value in row.items():
            if isinstance(value, (str, bytes, Mapping, list, tuple)):
                continue  # not a scalar metric (a label, a histogram, a list)
            number = _as_number(value)
            bucket = values.setdefault(key, [])
            if number is not None and math.isfinite(number):
                bucket.append(number)
    out: dict[str, float] = {}
    for key, xs in values.items():
        how = reduce.get(key, "mean")
        if how not in REDUCERS:
            raise ValueError(f"aggregate_metrics: unknown reduction '{how}' for '{key}'")
        out[key] = float(REDUCERS[how](xs)) if xs else math.nan
    return out


def count_values(values: Iterable[int]) -> dict[str, int]:
    """Histogram as a JSON-ready dict, e.g. staleness per sample -> `{"0": 12, "1": 4}`."""
    counts = Counter(int(v) for v in values)
    return {str(k): counts[k] for k in sorted(counts)}


def read_metrics(run_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """(train step lines, eval lines) of a run directory, in file order."""
    train, evals = [], []
    for row in iter_jsonl(Path(run_dir) / METRICS_FILE):
        if "step" not in row:
            continue
        (evals if row.get("kind") == "eval" else train).append(row)
    return train, evals


class MetricsTracker:
    """Writes a run's metrics, samples and timeline; mirrors scalars to `report_to` sinks.

    `resume_step`: truncate files to lines with step <= it and continue the run
    clock from there. `overwrite`: start the files empty (a fresh run reusing a
    directory). Neither: append to whatever is there.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        resume_step: int | None = None,
        overwrite: bool = False,
        report_to: Iterable[str] = (),
        config: Mapping[str, Any] | None = None,
        project: str = "asyncgrpo",
        sinks: Iterable[Sink] | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if overwrite:
            for name in (METRICS_FILE, SAMPLES_FILE, TIMELINE_FILE):
                (self.run_dir / name).unlink(missing_ok=True)
        self._metrics = JsonlWriter(self.run_dir / METRICS_FILE)
        self._samples = JsonlWriter(self.run_dir / SAMPLES_FILE)
        self._timeline_file = JsonlWriter(self.run_dir / TIMELINE_FILE)
        self._t0 = time.monotonic()
        self.timeline = Timeline(self.elapsed, self._timeline_file)
        self.last_eval: dict | None = None  # the newest eval line, for the progress line
        self._eval_steps: set[int] = set()
        if resume_step is not None:
            self.truncate_after(resume_step)
        else:
            self._read_evals()
        extra = list(report_to)
        cfg = to_jsonable(dict(config)) if config is not None else None
        self.sinks: list[Sink] = list(sinks or []) + make_sinks(
            extra, self.run_dir, project=project, config=cfg
        )

    # -- clock ---------------------------------------------------------------------------------
    def elapsed(self) -> float:
        """Seconds on the run clock (continues across resumes)."""
        return time.monotonic() - self._t0

    def span(self, role: str):
        """`with tracker.span("trainer"):` marks a role busy (see `Timeline.span`)."""
        return self.timeline.span(role)

    # -- writing -------------------------------------------------------------------------------
    def log_step(self, step: int, metrics: Mapping[str, Any]) -> dict:
        """Append the line for optimizer step `step`; `time_s` is filled in if absent."""
        return self._log("train", step, metrics)

    def log_eval(self, step: int, metrics: Mapping[str, Any]) -> dict:
        """Append a held-out evaluation line (`eval_reward_mean`, ...) for `step`."""
        self.last_eval = self._log("eval", step, metrics)
        self._eval_steps.add(int(step))
        return self.last_eval

    def has_eval(self, step: int) -> bool:
        """Whether metrics.jsonl already holds an evaluation of `step`."""
        return int(step) in self._eval_steps

    def _read_evals(self) -> None:
        evals = read_metrics(self.run_dir)[1]
        self._eval_steps = {int(r["step"]) for r in evals if _is_num(r["step"])}
        self.last_eval = evals[-1] if evals else None

    def log_samples(self, step: int, rows: Iterable[Mapping[str, Any]]) -> None:
        """Append sampled completions (prompt, completion, reward, ...) for `step`."""
        for row in rows:
            self._samples.write({"step": int(step), **row})

    def _log(self, kind: str, step: int, metrics: Mapping[str, Any]) -> dict:
        line = {"kind": kind, "step": int(step), "time_s": round(self.elapsed(), 3)}
        line.update({k: v for k, v in metrics.items() if k not in ("kind", "step")})
        line = to_jsonable(line)
        self._metrics.write(line)
        scalars = flat_scalars({k: v for k, v in line.items() if k not in ("kind", "step")})
        for sink in self.sinks:
            sink.log(int(step), scalars, kind)
        return line

    # -- resuming ------------------------------------------------------------------------------
    def truncate_after(self, step: int) -> None:
        """Drop metric and sample lines with step > `step`, and timeline past the last kept time.

        The run clock continues from the last kept `time_s` (0 if none).
        Intervals this process recorded before the call are discarded (their
        times were on the old clock); spans still open restart at the resume time.
        """
        self._metrics.rewrite(lambda rows: [r for r in rows if _step_of(r) <= step])
        self._samples.rewrite(lambda rows: [r for r in rows if _step_of(r) <= step])
        self._read_evals()
        times = [r["time_s"] for r in iter_jsonl(self._metrics.path) if _is_num(r.get("time_s"))]
        resume_time = float(max(times, default=0.0))

        def clip(rows: list[dict]) -> list[dict]:
            kept = [
                r
                for r in rows
                if _is_num(r.get("start_s")) and _is_num(r.get("end_s"))
                if r["start_s"] < resume_time
            ]
            return [{**r, "end_s": min(r["end_s"], resume_time)} for r in kept]

        def rebase() -> float:
            self._timeline_file.rewrite(clip, drop_own=True)
            self._t0 = time.monotonic() - resume_time
            return resume_time

        self.timeline.rebase(rebase)

    def close(self) -> None:
        self.timeline.close()
        for writer in (self._metrics, self._samples, self._timeline_file):
            writer.close()
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> MetricsTracker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _step_of(row: Mapping[str, Any]) -> float:
    return row["step"] if _is_num(row.get("step")) else math.inf
