"""`asyncgrpo train`: the whole asynchronous algorithm on one screen.

Rollouts stream from the engine on a background loop (the orchestrator) while
this loop takes scored groups from the buffer, steps the optimizer and sends
weights back every `weight_sync_steps`. The buffer's throttle bounds how far
generation runs ahead (`max_staleness`); with `max_staleness: 0` the very same
loop is synchronous on-policy GRPO.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

from asyncgrpo.config import RunConfig
from asyncgrpo.metrics import plot_run
from asyncgrpo.metrics.progress import ProgressDisplay
from asyncgrpo.pipeline import Pipeline, RunAborted
from asyncgrpo.wiring import build_pipeline

logger = logging.getLogger(__name__)


def train(cfg: RunConfig, *, resume: str | Path | None = None, **components) -> Path:
    """Train until `max_steps` (or `max_time_s`, or a signal); return the run directory."""
    stop = _stop_on_signals()
    p: Pipeline = build_pipeline(cfg, resume=resume, **components)
    try:
        p.start_engine()
        if resume:
            p.resume(Path(resume))
        p.sync_weights()  # the engine samples with the trainer's weights from the start
        p.start_rollouts()
        progress = ProgressDisplay(cfg.max_steps, start_step=p.step, max_time_s=cfg.max_time_s)
        while p.step < cfg.max_steps and not stop.is_set() and not p.out_of_time():
            groups = p.next_batch(stop)
            if groups is None:
                break
            p.maybe_eval()  # after the batch is in, so evaluating never delays it
            with p.tracker.span("trainer"):
                metrics = p.trainer.step(groups)
            p.consumed(groups)
            if p.step % cfg.coordinator.weight_sync_steps == 0:
                p.sync_weights()
            p.maybe_checkpoint()
            progress.update(p.step, p.log(metrics, groups))
        progress.close()
        p.maybe_checkpoint(force=True)
        if not stop.is_set():
            p.maybe_eval(final=True)
    finally:
        p.close()
    plot_run(p.run_dir)
    return p.run_dir


def _stop_on_signals() -> threading.Event:
    """SIGINT/SIGTERM ask for a clean stop (checkpoint, then exit); a second SIGINT is immediate."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        return stop

    def handler(signum, frame):
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        logger.warning("received %s: checkpointing and stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return stop


def main(argv: list[str] | None = None) -> int:
    """`asyncgrpo train CONFIG.yaml [--set key=value ...] [--resume RUN_DIR]`."""
    import argparse

    from asyncgrpo.config import ConfigError, describe, load_config

    parser = argparse.ArgumentParser(
        prog="asyncgrpo train", description="Train with asynchronous GRPO from a recipe."
    )
    parser.add_argument("config", nargs="?", help="recipe YAML (see recipes/)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field by its dotted path, e.g. --set trainer.learning_rate=2e-5",
    )
    parser.add_argument(
        "--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint"
    )
    parser.add_argument("--help-config", action="store_true", help="list every config field")
    args = parser.parse_args(argv)
    if args.help_config:
        print("\n".join(describe()))
        return 0
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine request otherwise
    try:
        config_path = args.config
        if config_path is None and args.resume:
            config_path = str(Path(args.resume) / "config.yaml")  # the run's resolved config
        if config_path is None:
            parser.error("a recipe is required (or --resume RUN_DIR)")
        cfg = load_config(config_path, args.overrides)
        run_dir = train(cfg, resume=args.resume)
    except ConfigError as exc:
        print(f"error: {exc}")
        return 2
    except RunAborted as exc:
        print(f"run aborted: {exc}")
        return 1
    print(f"run directory: {run_dir}")
    return 0
