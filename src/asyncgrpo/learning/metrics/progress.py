"""Terminal progress: one live line on a TTY, periodic plain lines otherwise.

On a terminal the line is a tqdm bar (tqdm comes with transformers) whose
postfix shows the train reward, the last held-out reward (and the step it was
taken at), staleness and both throughputs. When the stream is not a TTY (CI
logs, `nohup`, a pipe) carriage-return redraws would produce garbage, so the
display prints a full plain line every `log_every_steps` optimizer steps (every
step by default), plus the first and the last.

ETA is measured from the steps done in this process (a resumed run does not
count the steps it inherited); the plain lines also cap it by the wall-clock
budget (`max_time_s`) when one is set, while the live bar shows tqdm's estimate.
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _num(metrics: Mapping[str, Any], key: str) -> float:
    value = metrics.get(key)
    try:
        return float(value) if value is not None else math.nan
    except (TypeError, ValueError):
        return math.nan


def _fmt(value: float, spec: str) -> str:
    return format(value, spec) if math.isfinite(value) else "-"


def summarize(metrics: Mapping[str, Any]) -> str:
    """`reward 0.42 | held-out 0.50 @20 | stale 0.8/2 | gen 210 tok/s | train 140 tok/s`
    from a step line (the held-out part once an evaluation is logged)."""
    parts = [f"reward {_fmt(_num(metrics, 'reward_mean'), '.3f')}"]
    if "eval_reward_mean" in metrics:
        at = f" @{metrics['eval_step']}" if "eval_step" in metrics else ""
        parts.append(f"held-out {_fmt(_num(metrics, 'eval_reward_mean'), '.3f')}{at}")
    stale_mean, stale_max = _num(metrics, "staleness_mean"), _num(metrics, "staleness_max")
    parts.append(f"stale {_fmt(stale_mean, '.1f')}/{_fmt(stale_max, '.0f')}")
    parts.append(f"gen {_fmt(_num(metrics, 'gen_tokens_per_s'), '.0f')} tok/s")
    parts.append(f"train {_fmt(_num(metrics, 'train_tokens_per_s'), '.0f')} tok/s")
    return " | ".join(parts)


class ProgressDisplay:
    """`update(step, metrics)` after each optimizer step; `close()` at the end."""

    def __init__(
        self,
        max_steps: int,
        *,
        start_step: int = 0,
        max_time_s: float | None = None,
        stream: TextIO | None = None,
        log_every_steps: int = 1,
        live: bool | None = None,
        clock=time.monotonic,
    ):
        self.max_steps = max_steps
        self.start_step = start_step
        self.max_time_s = max_time_s
        self.stream = stream if stream is not None else sys.stderr
        self.log_every_steps = max(int(log_every_steps), 1)
        self._clock = clock
        self._t_start = clock()
        self._printed_any = False
        self._step = start_step
        if live is None:
            live = bool(getattr(self.stream, "isatty", lambda: False)())
        self._bar = self._make_bar() if live else None

    def _make_bar(self):
        try:
            from tqdm.auto import tqdm
        except ImportError:  # plain lines still work
            return None
        columns = shutil.get_terminal_size(fallback=(0, 0)).columns
        return tqdm(
            total=self.max_steps,
            initial=self.start_step,
            unit="step",
            file=self.stream,
            # a pty that reports 0 columns would make tqdm draw an empty line
            dynamic_ncols=columns > 0,
            ncols=None if columns > 0 else 120,
        )

    def eta_s(self, step: int, elapsed_s: float | None = None) -> float:
        """Seconds left: steps-based, capped by the time budget (NaN before the first step)."""
        now = self._clock()
        done = step - self.start_step
        remaining = math.nan
        if done > 0:
            remaining = (now - self._t_start) / done * max(self.max_steps - step, 0)
        if self.max_time_s is not None and elapsed_s is not None and math.isfinite(elapsed_s):
            budget_left = max(self.max_time_s - elapsed_s, 0.0)
            remaining = budget_left if math.isnan(remaining) else min(remaining, budget_left)
        return remaining

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Show `step` (the number of optimizer steps completed) and its metrics."""
        advance, self._step = step - self._step, step
        if self._bar is not None:
            self._bar.set_postfix_str(summarize(metrics), refresh=False)
            self._bar.update(max(advance, 0))
            return
        first_or_last = step >= self.max_steps or not self._printed_any
        if first_or_last or step % self.log_every_steps == 0:
            self._printed_any = True
            eta = self.eta_s(step, _num(metrics, "time_s"))
            width = len(str(self.max_steps))
            self.write(
                f"step {step:>{width}}/{self.max_steps} | {summarize(metrics)} | "
                f"eta {format_duration(eta)}"
            )

    def write(self, message: str) -> None:
        """Print a message without breaking the live line."""
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
