"""The one place a run is assembled: a `RunConfig` (and optional user objects) to a `RunContext`.

`build_run` reads top to bottom as the run comes up: inputs checked (rewards, an
environment's episode source, prompt rows) before anything starts; the run directory
and its resolved config; the engine launched (it loads its model while this process
loads the policy); the trainer; the group builder; then `assemble_run` puts the
roles together with the parts around them — prompt stream, buffer, orchestrator,
loop thread, engine link, evaluator, checkpoints, metric rows and the session's parts
(`session/`), each configured from its own section. The roles themselves are
resolved from the config's names in `roles.py`; the loop that drives the result is
`loop.py`. What the run closes is registered here, in order.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from asyncgrpo.base.config import RunConfig
from asyncgrpo.base.loop_thread import LoopThread
from asyncgrpo.inference.backend import EngineBackend
from asyncgrpo.inference.core_share import lend_to, share_engine_cores
from asyncgrpo.learning.coordinator.buffer import RolloutBuffer
from asyncgrpo.learning.environments import wants_source
from asyncgrpo.learning.metrics.rows import StepRows
from asyncgrpo.learning.metrics.tracker import MetricsTracker
from asyncgrpo.learning.rollout.builder import GroupBuilder
from asyncgrpo.learning.rollout.orchestrator import Orchestrator
from asyncgrpo.learning.rollout.prompts import PromptStream
from asyncgrpo.learning.trainer.base import Trainer
from asyncgrpo.learning.trainer.best import BestKeeper
from asyncgrpo.learning.trainer.build import huge_pages_early, make_trainer
from asyncgrpo.learning.trainer.checkpoint import Checkpointer
from asyncgrpo.run.context import RunContext
from asyncgrpo.run.evaluation import Evaluator
from asyncgrpo.run.roles import (
    checked_inputs,
    close_started,
    engine_backend,
    engine_model_dir,
    group_builder,
    policy_and_tokenizer,
    ray_cluster,
    trainer_ranks,
)
from asyncgrpo.run.session.activity import Activity
from asyncgrpo.run.session.batches import BatchWaiter
from asyncgrpo.run.session.clock import RunClock
from asyncgrpo.run.session.engine_link import EngineLink
from asyncgrpo.run.session.status import PipelineStatus

logger = logging.getLogger(__name__)


def build_run(
    cfg: RunConfig,
    *,
    resume: str | Path | None = None,
    model: Any = None,
    tokenizer: Any = None,
    reward_funcs: list | None = None,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    rollout_func: Any = None,
    tools: list | None = None,
    environment_factory: Any = None,
) -> RunContext:
    """The run `cfg` describes, ready for `loop.run_to_end`: objects passed by the Python API
    (`model`, `reward_funcs`, datasets, a rollout, TRL tools or environment classes) take
    precedence over the config's names. What started is closed again if a step fails."""
    huge_pages_early(cfg)  # first: torch fixes it at the process's first tensor
    funcs = reward_funcs if reward_funcs is not None else list(cfg.rewards)
    from_env = wants_source(cfg, tools, environment_factory)
    agent = rollout_func is not None or cfg.agent.source is not None or from_env
    env = (tools, environment_factory) if from_env else None
    datasets = (train_dataset, eval_dataset)
    rewards, source, train_rows, eval_rows = checked_inputs(cfg, funcs, agent, datasets, env)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.trainer.num_threads)
    engine = trainer = cluster = None
    try:
        run_dir = Path(resume) if resume else Path(cfg.output_dir) / cfg.name
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
        model_dir = engine_model_dir(cfg, model, tokenizer, run_dir)
        cluster = ray_cluster(cfg, run_dir)
        engine = engine_backend(cfg, model_dir, run_dir, agent, cluster)
        busy_flag = share_engine_cores(cfg, engine)
        engine.launch()  # the engine loads its copy of the model while this process loads its own
        model, tokenizer = policy_and_tokenizer(cfg, model, tokenizer, model_dir)
        tracker = MetricsTracker(
            run_dir, overwrite=resume is None, report_to=cfg.report_to, config=cfg.model_dump()
        )
        trainer = make_trainer(cfg, model, run_dir, model_dir, *trainer_ranks(cfg, cluster))
        lender = lend_to(trainer, busy_flag, cfg)
        builder = group_builder(cfg, engine.client, tokenizer, rewards, rollout_func, source)
        repeats = cfg.agent.eval_repeats if agent else 1  # sampled episodes: average some
        run = assemble_run(
            cfg,
            run_dir,
            engine,
            trainer,
            builder,
            tracker,
            train_rows,
            eval_rows,
            rewards=rewards,
            eval_repeats=repeats,
        )
    except BaseException:
        close_started(rewards, trainer, engine, cluster, source)
        raise
    _add_closers(run, source, cluster, lender)
    return run


def _add_closers(run: RunContext, source, cluster, lender) -> None:
    """What the run closes after its engines and trainer, in order."""
    if source is not None:
        run.closers.extend(source.closers)
    if cluster is not None:
        run.closers.append(cluster.shutdown)  # after the engines and the ranks
    if lender is not None:
        run.closers.append(lender.remove)  # the model may outlive the run (`api.py`)


def assemble_run(
    cfg: RunConfig,
    run_dir: Path,
    engine: EngineBackend,
    trainer: Trainer,
    builder: GroupBuilder,
    tracker: Any,
    train_rows: Any,
    eval_rows: Any,
    rewards: Any = None,
    eval_repeats: int = 1,
) -> RunContext:
    """The run around its three roles: prompt stream, buffer, orchestrator, loop thread,
    evaluator, checkpoints and metric rows, each configured from its own section, and the
    session's parts (`session/`). `rewards`, the builder's `RewardRunner` if any, is closed
    with the run."""
    prompts = PromptStream(train_rows, cfg.seed)
    buffer = _buffer(cfg, prompts)
    orchestrator = _orchestrator(cfg, builder, buffer, prompts)
    loop = LoopThread()
    weight_dtype = getattr(torch, cfg.engine.resolved_dtype())
    activity, clock = Activity(tracker), RunClock(cfg.max_time_s)
    link = EngineLink(
        engine, loop, trainer, buffer, activity, weight_dtype, cfg.coordinator.sync_mode
    )
    best = _best(cfg, trainer, run_dir, eval_rows)
    evaluator = _evaluator(cfg, builder, eval_rows, loop, tracker, eval_repeats, link.landed, best)
    checkpoints = Checkpointer(
        trainer,
        run_dir,
        cfg.checkpoint_steps,
        cfg.save_weights_steps,
        weight_dtype,
        keep=cfg.save_total_limit,
    )
    status = PipelineStatus(activity, buffer, orchestrator, link, trainer, rewards)
    batches = BatchWaiter(
        buffer, orchestrator, link, clock, activity, cfg.rollout.request_timeout_s, status.report
    )
    return RunContext(
        cfg=cfg,
        run_dir=run_dir,
        loop=loop,
        link=link,
        buffer=buffer,
        prompts=prompts,
        orchestrator=orchestrator,
        trainer=trainer,
        evaluator=evaluator,
        checkpoints=checkpoints,
        rows=StepRows(tracker, buffer, builder, advantage=cfg.advantage),
        tracker=tracker,
        activity=activity,
        clock=clock,
        batches=batches,
        status=status,
        closers=[rewards.close] if rewards is not None else [],
        rewards=rewards,
    )


def _orchestrator(
    cfg: RunConfig, builder: GroupBuilder, buffer: RolloutBuffer, prompts: PromptStream
) -> Orchestrator:
    r = cfg.rollout
    return Orchestrator(
        builder,
        buffer,
        prompts,
        filter_zero_variance=r.filter_zero_variance,
        max_concurrent_groups=r.max_concurrent_groups,
        on_reward_error=r.reward_error_policy,
    )


def _evaluator(
    cfg: RunConfig,
    builder: GroupBuilder,
    rows: Any,
    loop: LoopThread,
    tracker: Any,
    repeats: int,
    landed: Callable[[], Awaitable[None]],
    best: BestKeeper | None,
) -> Evaluator:
    return Evaluator(
        builder,
        rows,
        loop,
        tracker,
        landed=landed,
        every=cfg.eval_steps,
        limit=cfg.eval_limit,
        repeats=repeats,
        timeout_s=cfg.rollout.request_timeout_s,
        best=best,
    )


def _best(cfg: RunConfig, trainer: Trainer, run_dir: Path, rows: Any) -> BestKeeper | None:
    """The keeper of the best evaluation's weights, where there are evaluations and a metric."""
    if rows is None or cfg.best_checkpoint_metric is None:
        return None
    return BestKeeper(trainer, run_dir, cfg.best_checkpoint_metric, cfg.best_checkpoint_mode)


def _buffer(cfg: RunConfig, prompts: PromptStream) -> RolloutBuffer:
    c = cfg.coordinator
    ahead = c.max_ahead_batches
    return RolloutBuffer(
        c.batch_groups,
        c.max_staleness,
        on_group_end=prompts.done,  # a prompt whose group ended is never served again
        max_ahead=None if ahead is None else math.ceil(ahead * c.batch_groups),
    )
