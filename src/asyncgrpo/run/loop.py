"""`asyncgrpo train`: the whole asynchronous algorithm on one screen.

Two halves run at once. The producer, `continuous_rollouts`, is a coroutine on
the rollout loop: while the buffer's throttle admits more work, it turns the
next prompt row into a scored group (the `GroupBuilder`: generate, score) that
lands in the buffer. The consumer, `continuous_training`, runs on the main
thread: it takes batches of groups from the buffer, steps the optimizer and
sends the weights back to the engine every `weight_sync_steps`. The throttle
bounds how far generation runs ahead (`max_staleness`); with `max_staleness: 0`
the very same loop is synchronous on-policy GRPO.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from pathlib import Path

from asyncgrpo.base.config import RunConfig
from asyncgrpo.learning.coordinator.buffer import BufferClosed
from asyncgrpo.learning.metrics import plot_run
from asyncgrpo.learning.metrics.progress import ProgressDisplay
from asyncgrpo.learning.trainer.best import best_summary
from asyncgrpo.learning.trainer.distributed import TrainerFailed, launched_rank
from asyncgrpo.run.build import build_run
from asyncgrpo.run.context import RunContext
from asyncgrpo.run.session import RunAborted
from asyncgrpo.run.session.engine_link import record_engine_busy

logger = logging.getLogger(__name__)


def train(cfg: RunConfig, *, resume: str | Path | None = None, **components) -> Path:
    """Train until `max_steps` (or `max_time_s`, or a signal); return the run directory.

    Under torchrun / accelerate, ranks above 0 only train: they follow rank 0."""
    launched = launched_rank()
    if launched is not None and launched[0] > 0:
        from asyncgrpo.learning.trainer.follower import run_follower

        run_follower(cfg)
        return Path(resume) if resume else Path(cfg.output_dir) / cfg.name
    stop = _stop_on_signals()
    r: RunContext = build_run(cfg, resume=resume, **components)
    run_to_end(r, stop, resume=resume is not None)
    plot_run(r.run_dir)
    if summary := best_summary(r.run_dir, r.tracker.last_eval):
        logger.info("%s (best/, what `asyncgrpo export` writes)", summary)
    return r.run_dir


def run_to_end(r: RunContext, stop: threading.Event, resume: bool = False) -> None:
    """Start the engine, run both halves until done, checkpoint, evaluate; close `r`."""
    try:
        r.link.start()
        if resume:
            r.resume()
        r.publish_trainer_state()
        r.link.sync_weights()  # the engine samples with the trainer's weights from the start
        r.link.settle()
        r.start_watchdog()  # logs what the run waits for whenever nothing moves
        r.producer = r.loop.submit(continuous_rollouts(r))
        continuous_training(r, stop)
        r.link.settle()  # the final evaluation samples with the last weights
        r.checkpoint(force=True)
        if not stop.is_set() and not r.clock.out_of_time():  # the budget covers evaluation too
            with r.activity.doing("final evaluation"):
                r.evaluator.maybe_start(r.step, final=True)
    finally:
        r.close()


async def continuous_rollouts(r: RunContext) -> None:
    """Producer: prompt rows -> scored groups -> buffer, as fast as the throttle admits."""
    busy = asyncio.create_task(record_engine_busy(r.engine.client, r.tracker))
    try:
        while not r.orchestrator.stopping:
            await asyncio.sleep(r.orchestrator.backoff_s())  # 0 unless groups keep failing
            try:  # the staleness throttle: block until one more group may start
                admitted = await asyncio.to_thread(r.buffer.wait_admit, 0.2)
            except BufferClosed:
                break
            if admitted:
                r.orchestrator.start_next()
    except Exception as exc:  # a bug here: the trainer's wait for a batch must hear of it
        r.orchestrator.abort(RuntimeError(f"rollouts stopped: {exc!r}"))
        raise
    finally:
        busy.cancel()
        await r.orchestrator.drain()


def continuous_training(r: RunContext, stop: threading.Event) -> None:
    """Consumer: batches -> optimizer steps; weights back to the engine as they change."""
    cfg = r.cfg
    progress = ProgressDisplay(cfg.max_steps, start_step=r.step, max_time_s=cfg.max_time_s)
    # out of time before this session's first step, `batches.next` raises, saying why
    while r.step < cfg.max_steps and not stop.is_set() and not r.clock.time_up(r.step):
        groups = r.batches.next(stop, r.step)  # fresh groups only: too-stale ones are dropped
        if groups is None:
            break
        r.evaluator.maybe_start(r.step)  # after the batch is in, so it never delays it
        with r.activity.doing("optimizer step", span="trainer"):
            metrics = r.trainer.step(groups)
        r.publish_trainer_state()  # reward functions see the step
        if r.step % cfg.coordinator.weight_sync_steps == 0:
            r.link.sync_weights()
        # the row first: a crash between the two then repeats the step on resume (the
        # checkpoint is older) instead of losing its row (the checkpoint would be newer)
        progress.update(r.step, r.log(metrics, groups))
        r.checkpoint()
    progress.close()


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

    from asyncgrpo.base.config import ConfigError, describe, load_config

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
    except (RunAborted, TrainerFailed) as exc:
        print(f"run aborted: {exc}")
        return 1
    if launched_rank() is None or launched_rank()[0] == 0:
        print(f"run directory: {run_dir}")
    return 0
