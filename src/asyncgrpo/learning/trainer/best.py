"""The best weights a run held, by held-out evaluation: what a run leaves is its best, not its last.

A policy can swing late in a run (held-out greedy reward rising to a peak, then falling
over the last steps while the training reward stays level), and the last step's weights
are then not the model a user wants. So when an evaluation starts at step s, the keeper
copies the trainer's weights of step s (full precision, in host memory: one copy, held
only while that evaluation runs); when its result is logged and its metric
(`best_checkpoint_metric`, `eval_reward_mean` by default) beats every earlier one, the copy
is written to `best/model.safetensors` with `best/best.json` (step, metric, value), each
atomically. `asyncgrpo export` and `AsyncGRPOTrainer.save_model` write these weights by
default.

Evaluations run beside training and sample with the weights of the last sync (`run/
evaluation.py`), so the weights kept are the trainer's at the step the evaluation is
labelled with, the policy it was meant to measure. An evaluation that fails, or whose row
lacks the metric (a NaN included), changes nothing. A resumed run reads `best.json` and
keeps comparing against it.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from asyncgrpo.learning.trainer.checkpoint import copy_named, write_json, write_weights

logger = logging.getLogger(__name__)

BEST_DIR = "best"
WEIGHTS_FILE = "model.safetensors"
RECORD_FILE = "best.json"


def read_best(run_dir: str | Path) -> dict[str, Any] | None:
    """`best/best.json` of a run ({step, metric, value, mode}), or None when it kept none."""
    path = Path(run_dir) / BEST_DIR / RECORD_FILE
    weights = path.parent / WEIGHTS_FILE
    if not (path.is_file() and weights.is_file()):
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def improves(value: float, best: float | None, mode: str) -> bool:
    """Whether `value` beats `best` (None: nothing yet) in `mode` ("max" or "min"); a tie
    keeps the earlier step."""
    if best is None:
        return True
    return value > best if mode == "max" else value < best


class BestKeeper:
    def __init__(self, trainer: Any, run_dir: str | Path, metric: str, mode: str = "max"):
        """`trainer`: whose `named_weights()` are copied when an evaluation starts."""
        self.trainer = trainer
        self.directory = Path(run_dir) / BEST_DIR
        self.metric = metric
        self.mode = mode
        record = read_best(run_dir)
        same = record is not None and (record.get("metric"), record.get("mode")) == (metric, mode)
        self.best: dict[str, Any] | None = record if same else None
        self._candidate: tuple[int, dict[str, torch.Tensor]] | None = None

    def evaluation_started(self, step: int) -> None:
        """Copy the weights of `step` (one candidate at a time: one evaluation runs at once)."""
        self._candidate = step, copy_named(self.trainer.named_weights())

    def evaluation_logged(self, step: int, row: dict[str, Any] | None) -> None:
        """Keep the candidate of `step` if `row` (the logged evaluation) beats the best."""
        candidate, self._candidate = self._candidate, None
        if candidate is None or candidate[0] != step or row is None:
            return
        value = row.get(self.metric)
        if not isinstance(value, int | float) or math.isnan(value):
            return
        if improves(float(value), self.best["value"] if self.best else None, self.mode):
            self._write(step, float(value), candidate[1])

    def evaluation_failed(self) -> None:
        self._candidate = None

    def _write(self, step: int, value: float, weights: dict[str, torch.Tensor]) -> None:
        record = {"step": step, "metric": self.metric, "value": value, "mode": self.mode}
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            write_weights(self.directory / WEIGHTS_FILE, weights)
            write_json(self.directory / RECORD_FILE, record)
        except OSError as exc:  # a full disk: the previous best stays, training goes on
            logger.error("best weights of step %d not written (%s)", step, exc)
            return
        self.best = record
        logger.info("best %s so far: %.4g at step %d", self.metric, value, step)


def best_summary(run_dir: str | Path, last_eval: dict[str, Any] | None) -> str | None:
    """One line for the end of a run: which step's weights are the best, and how far the
    last evaluation fell from it; None when no best was kept."""
    best = read_best(run_dir)
    if best is None:
        return None
    metric = best["metric"]
    line = f"best {metric} {best['value']:.4g} at step {best['step']}"
    last = (last_eval or {}).get(metric)
    if not isinstance(last, int | float) or math.isnan(last):
        return line
    if last_eval["step"] == best["step"]:
        return f"{line}, the last evaluation"
    return f"{line}; the last evaluation, step {last_eval['step']}: {last:.4g} ({last - best['value']:+.4g})"
