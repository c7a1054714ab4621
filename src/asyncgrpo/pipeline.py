"""Wiring of the four roles, and the chores between optimizer steps.

`Pipeline` holds the engine (a supervised child process, which `build_pipeline`
creates and starts before loading the trainer's model, or an external server) and
builds the client, the buffer, the orchestrator and the trainer from a `RunConfig`. It offers
the few verbs the top-level loop in `run.py` uses: `sync_weights`, `next_batch`,
`consumed`, `maybe_eval`, `maybe_checkpoint`, `log`, `close`. Everything here is
plumbing; the algorithm is in `run.py`, the maths in `trainer/`, the staleness
rules in `coordinator/`.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncgrpo.client import EngineClient
from asyncgrpo.client.retry import RetryPolicy
from asyncgrpo.config import RunConfig
from asyncgrpo.coordinator.buffer import RolloutBuffer
from asyncgrpo.engine.process import EngineProcess
from asyncgrpo.loop_thread import LoopThread
from asyncgrpo.rollout.episodes import EpisodeGroupBuilder, EpisodeSettings, load_rollout
from asyncgrpo.rollout.orchestrator import GenerationSettings, Orchestrator
from asyncgrpo.rollout.prompts import PromptStream
from asyncgrpo.rollout.types import Group, Rollout
from asyncgrpo.trainer import advantages as adv_mod
from asyncgrpo.trainer import losses as loss_mod
from asyncgrpo.trainer.checkpoint import (
    TrainingState,
    copy_weights,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    write_weights,
)
from asyncgrpo.trainer.loop import OptimConfig, PolicyTrainer
from asyncgrpo.transport import make_transport

logger = logging.getLogger(__name__)


class RunAborted(RuntimeError):
    """The run cannot continue (a fatal reward error, an engine that will not come back)."""


def loss_config(cfg: RunConfig) -> loss_mod.LossConfig:
    c = cfg.loss
    return loss_mod.LossConfig(
        loss=c.name,
        epsilon_low=c.epsilon_low,
        epsilon_high=c.epsilon_high,
        ratio_level=c.ratio_level,
        delta=c.delta,
        aggregation=c.aggregation,
        correction=c.correction,
        correction_cap=c.correction_cap,
        opsm_delta=c.opsm_delta,
        beta=c.beta,
    )


def optim_config(cfg: RunConfig) -> OptimConfig:
    t = cfg.trainer
    return OptimConfig(
        learning_rate=t.learning_rate,
        weight_decay=t.weight_decay,
        warmup_steps=t.warmup_steps,
        lr_schedule=t.lr_schedule,
        max_steps=cfg.max_steps,
        max_grad_norm=t.max_grad_norm,
        micro_batch_tokens=t.micro_batch_tokens,
        bf16_autocast=t.use_bf16_autocast(),
        old_logprobs=t.old_logprobs,
        temperature=cfg.rollout.temperature or 1.0,
        max_completion_length=cfg.rollout.max_tokens,
    )


class Pipeline:
    def __init__(
        self,
        cfg: RunConfig,
        *,
        model: torch.nn.Module,
        tokenizer: Any,
        train_rows: Any,
        eval_rows: Any,
        reward_runner: Any,
        tracker: Any,
        run_dir: Path,
        engine: EngineProcess | None,
        rollout_func: Any = None,
    ):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.tracker = tracker
        self.run_dir = run_dir
        self.eval_rows = eval_rows
        self.reward_runner = reward_runner
        self.adv_cfg = adv_mod.AdvantageConfig(scale=cfg.advantage.scale_rewards)
        self.trainer = PolicyTrainer(
            model, loss_config(cfg), self.adv_cfg, optim_config(cfg), cfg.advantage.reward_weights
        )
        self.weight_dtype = getattr(torch, cfg.model.engine_dtype())
        self._snapshot_writer = concurrent.futures.ThreadPoolExecutor(1, "weights-writer")
        self._snapshot_write: concurrent.futures.Future | None = None
        self.loop = LoopThread()
        self.engine = engine  # None: an external server at `engine.base_url`
        retry = RetryPolicy(
            deadline=cfg.engine.startup_timeout_s, max_attempts=1000, max_backoff=2.0
        )
        self.client = self.loop.run(self._make_client(retry))
        self.transport = make_transport("shm", self.client)
        c = cfg.coordinator
        self.buffer = RolloutBuffer(
            c.batch_groups,
            c.max_staleness,
            on_drop_stale=lambda g: self.prompts.done(g.data_index),
            max_ahead=None
            if c.max_ahead_batches is None
            else math.ceil(c.max_ahead_batches * c.batch_groups),
        )
        self.prompts = PromptStream(train_rows, cfg.seed)
        self.episodes = self._make_episodes(rollout_func)
        self.orchestrator = Orchestrator(
            client=self.client,
            buffer=self.buffer,
            prompts=self.prompts,
            render=self.render,
            decode=self.decode,
            score=self.score,
            is_zero_variance=self.is_zero_variance,
            settings=GenerationSettings(
                cfg.rollout.num_generations,
                cfg.rollout.max_tokens,
                cfg.rollout.temperature,
                cfg.rollout.top_p,
                cfg.seed,
            ),
            filter_zero_variance=cfg.rollout.filter_zero_variance,
            max_concurrent_groups=cfg.rollout.max_concurrent_groups,
            on_reward_error=cfg.rollout.reward_error_policy,
            build_group=self.episodes.build if self.episodes is not None else None,
        )
        self._rollouts = None
        self._eval_future = None
        self._last_eval_step: int | None = None
        self.start_time = time.monotonic()
        self.weight_sync_s = 0.0
        self._last = {"time": time.monotonic(), "t_run": 0.0, "gen_tokens": 0}

    # ---- construction ------------------------------------------------------------

    def _make_episodes(self, rollout_func: Any) -> EpisodeGroupBuilder | None:
        """Agent runs (`agent.rollout`, or a function passed in): groups of whole episodes."""
        a = self.cfg.agent
        if rollout_func is None and a.rollout is None:
            return None
        settings = EpisodeSettings(
            self.cfg.rollout.num_generations,
            a.max_turns,
            a.episode_timeout_s,
            a.call_timeout_s,
            a.max_infra_retries,
            dict(a.failure_rewards),
        )
        fn = rollout_func or load_rollout(a.rollout)
        return EpisodeGroupBuilder(
            self.client, fn, settings, self.decode, graders=self.reward_runner
        )

    async def _make_client(self, retry: RetryPolicy) -> EngineClient:
        if self.engine is None:
            token = os.environ.get(self.cfg.engine.admin_token_env)
            return EngineClient(self.cfg.engine.base_url, admin_token=token, retry=retry)
        return EngineClient(self.engine.base_url, admin_token=self.engine.admin_token, retry=retry)

    def start_engine(self) -> None:
        if self.engine is not None:
            self.engine.start()  # no-op when `build_pipeline` started it early
            # while the engine loads, lay the first weight sync's shared memory out
            self.loop.run(
                self.transport.prepare(list(self.trainer.named_weights(self.weight_dtype)))
            )
            self.engine.wait_ready(self.cfg.engine.startup_timeout_s)
            self.client.base_url = self.engine.base_url
        else:
            self.loop.run(self.client.wait_until_healthy(self.cfg.engine.startup_timeout_s))

    # ---- callbacks used by the orchestrator ---------------------------------------

    def render(self, prompt: Any) -> list[int]:
        from asyncgrpo.rollout.data import render_prompt

        return render_prompt(self.tokenizer, prompt)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def score(self, row: dict, rollouts: list[Rollout]) -> None:
        per_function = await self.reward_runner.score_group(
            row, [r.text for r in rollouts], [r.completion_ids for r in rollouts]
        )
        for i, r in enumerate(rollouts):
            r.rewards = [scores[i] for scores in per_function]

    def is_zero_variance(self, rollouts: list[Rollout]) -> bool:
        result = adv_mod.compute_advantages(
            [r.rewards for r in rollouts],
            [0] * len(rollouts),
            self.adv_cfg,
            self.cfg.advantage.reward_weights,
        )
        return bool(result.degenerate[0])

    # ---- verbs of the top-level loop ------------------------------------------------

    @property
    def step(self) -> int:
        return self.trainer.version

    def start_rollouts(self) -> None:
        self._rollouts = self.loop.submit(self.orchestrator.run())
        self._poller = self.loop.submit(self._poll_engine_busy())

    async def _poll_engine_busy(self, period: float = 0.5) -> None:
        """Turn the engine's cumulative busy seconds into timeline intervals."""
        import asyncio

        last_busy, last_t = None, self.tracker.elapsed()
        while True:
            await asyncio.sleep(period)
            try:
                stats = (await self.client.server_info()).get("stats", {})
            except Exception:
                continue
            busy, now = float(stats.get("busy_seconds", 0.0)), self.tracker.elapsed()
            if last_busy is not None and busy > last_busy:
                # the busy part of the window, placed at its end
                self.tracker.timeline.record("engine", max(last_t, now - (busy - last_busy)), now)
            last_busy, last_t = busy, now

    def sync_weights(self) -> None:
        """Publish the trainer's weights; the engine's version becomes the trainer's.

        An embedded engine that dies before or during the update is restarted and
        the update repeated, so a sync never waits on a dead process.
        """
        start = time.monotonic()
        mode = self.cfg.coordinator.sync_mode
        version = self.trainer.version
        weights = list(self.trainer.named_weights(self.weight_dtype))

        async def publish() -> None:
            await self.client.pause(mode)
            await self.transport.publish(weights, version)
            await self.client.resume()  # a restarted engine starts unpaused anyway

        with self.tracker.span("weight_sync"):
            for attempt in range(3):
                self._restart_dead_engine()
                future = self.loop.submit(publish())
                while True:
                    try:
                        future.result(timeout=0.5)
                        break
                    except concurrent.futures.TimeoutError:
                        if self.engine is not None and not self.engine.alive():
                            future.cancel()
                            break
                if future.done() and not future.cancelled():
                    break
                logger.warning("engine died during weight sync (attempt %d)", attempt + 1)
            else:
                raise RunAborted("the engine keeps dying during weight sync")
        self.buffer.set_engine_version(version)
        self.weight_sync_s = time.monotonic() - start

    def out_of_time(self) -> bool:
        budget = self.cfg.max_time_s
        return budget is not None and time.monotonic() - self.start_time >= budget

    def next_batch(self, stop: threading.Event) -> list[Group] | None:
        """Wait for a full batch of fresh groups, watching the engine and the orchestrator.

        Returns None when `stop` is set while waiting.
        """
        waited = 0.0
        while not stop.is_set():
            if self.orchestrator.fatal is not None:
                raise RunAborted(f"reward function failed: {self.orchestrator.fatal}")
            if self._rollouts is not None and self._rollouts.done() and self._rollouts.exception():
                raise RunAborted(f"rollouts stopped: {self._rollouts.exception()!r}")
            self._watch_engine()
            try:
                return self.buffer.get_batch(self.trainer.version, timeout=1.0)
            except TimeoutError:
                waited += 1.0
                if waited > self.cfg.rollout.request_timeout_s:
                    raise RunAborted(
                        f"no batch for {waited:.0f}s: {self.buffer.snapshot()}"
                    ) from None
        return None

    def _watch_engine(self) -> None:
        """Restart a dead embedded engine with the latest weights; requests retry into it."""
        if self._restart_dead_engine():
            self.sync_weights()

    def _restart_dead_engine(self) -> bool:
        if self.engine is None or self.engine.alive():
            return False
        logger.warning("engine process died; restarting it with weights of version %d", self.step)
        self.engine.restart(self.cfg.engine.startup_timeout_s)
        return True

    def consumed(self, groups: list[Group]) -> None:
        for g in groups:
            self.prompts.done(g.data_index)

    def maybe_eval(self, final: bool = False) -> None:
        """Evaluate on held-out prompts every `eval_steps` without blocking training.

        The evaluation runs on the rollout loop with the engine's current weights; its
        result is logged (with the step it started at) once it is done. `final` waits.
        """
        self._collect_eval(block=final)  # the final evaluation waits for one in flight
        if self.eval_rows is None:
            return
        due = final or self.step % self.cfg.eval_steps == 0
        if self._eval_future is None and due and self._last_eval_step != self.step:
            self._eval_future = (self.step, self.loop.submit(self.evaluate()))
            self._last_eval_step = self.step
        if final:
            self._collect_eval(block=True)

    def _collect_eval(self, block: bool) -> None:
        if self._eval_future is None:
            return
        step, future = self._eval_future
        if not block and not future.done():
            return
        self._eval_future = None
        try:
            self.tracker.log_eval(step, future.result(self.cfg.rollout.request_timeout_s))
        except Exception:
            logger.exception("evaluation at step %d failed", step)

    async def evaluate(self) -> dict[str, float]:
        """Greedy completions of every held-out prompt, scored by the reward functions."""
        import asyncio

        versions: set[int] = set()

        async def one(row: dict) -> list[float | None]:
            ids = self.render(row["prompt"])
            completion = await self.client.complete(
                ids, n=1, max_tokens=self.cfg.rollout.max_tokens, temperature=0.0
            )
            sample = completion.samples[0]
            versions.update(sample.weight_versions)
            rollout = Rollout(
                ids,
                sample.token_ids,
                sample.logprobs,
                sample.weight_versions,
                sample.finish_reason or "length",
                self.decode(sample.token_ids),
            )
            await self.score(row, [rollout])
            return rollout.rewards

        count = min(len(self.eval_rows), self.cfg.eval_limit or len(self.eval_rows))
        rows = [dict(self.eval_rows[i]) for i in range(count)]
        if self.episodes is not None:
            rows = rows * self.cfg.agent.eval_repeats
            return {**await self.episodes.evaluate(rows), "eval_version": self.step}
        scores = await asyncio.gather(*[one(r) for r in rows])
        weights = self.cfg.advantage.reward_weights or [1.0] * len(scores[0])
        totals = [
            sum(w * s for w, s in zip(weights, row, strict=True) if s is not None) for row in scores
        ]
        return {
            "eval_reward_mean": float(np.mean(totals)),
            "eval_count": len(totals),
            "eval_version": self.step,
            # the weights that actually answered (a sync may land during an evaluation)
            "eval_weight_version_min": min(versions, default=self.step),
            "eval_weight_version_max": max(versions, default=self.step),
        }

    def maybe_checkpoint(self, force: bool = False) -> None:
        every = self.cfg.save_weights_steps
        if every and self.step % every == 0 and not force:
            self._snapshot_weights()
        if not force and self.step % self.cfg.checkpoint_steps != 0:
            return
        state = TrainingState(
            step=self.step,
            version=self.trainer.version,
            data_position=self.prompts.state(),
            extra={"time_s": time.monotonic() - self.start_time},
        )
        save_checkpoint(
            self.run_dir / "checkpoints",
            self.trainer.model,
            self.trainer.optimizer,
            self.trainer.scheduler,
            state,
        )

    def _snapshot_weights(self) -> None:
        """Copy the weights now (in the engine's dtype: the policy that samples), write them
        in the background. For the 135M demo model in fp32 the copy took 0.3-0.4 s, writing
        0.8-1.3 s alone and 1.5-2.5 s beside a run; bf16 halves both."""
        weights = copy_weights(self.trainer.model, self.weight_dtype)
        self._wait_for_snapshot()  # one write at a time: memory stays bounded
        directory = self.run_dir / "weights"
        directory.mkdir(exist_ok=True)
        path = directory / f"step-{self.step:06d}.safetensors"
        self._snapshot_write = self._snapshot_writer.submit(write_weights, path, weights)

    def _wait_for_snapshot(self) -> None:
        if self._snapshot_write is not None:
            self._snapshot_write.result()
            self._snapshot_write = None

    def resume(self, run_dir: Path) -> None:
        path = latest_checkpoint(run_dir / "checkpoints")
        if path is None:
            raise RunAborted(f"no checkpoint to resume from in {run_dir / 'checkpoints'}")
        state = load_checkpoint(
            path, self.trainer.model, self.trainer.optimizer, self.trainer.scheduler
        )
        self.trainer.version = state.version
        self.prompts.load_state(state.data_position)
        self.start_time -= float(state.extra.get("time_s", 0.0))
        self.tracker.truncate_after(state.step)
        logger.info("resumed from %s at step %d", path, state.step)

    def log(self, metrics: dict[str, Any], groups: list[Group]) -> dict[str, Any]:
        now = time.monotonic()
        snap = self.buffer.snapshot()
        stale = self.buffer.staleness_seen[-len(groups) :]
        gen_tokens = self.orchestrator.generated_tokens
        dt = max(now - self._last["time"], 1e-9)
        row = dict(metrics)
        row.update(
            step=self.step,
            time_s=now - self.start_time,
            version=self.trainer.version,
            staleness_mean=float(np.mean(stale)) if stale else 0.0,
            staleness_max=int(max(stale)) if stale else 0,
            staleness_counts={str(k): v for k, v in sorted(Counter(stale).items())},
            dropped_stale=snap["dropped"].get("stale", 0),
            dropped=snap["dropped"],
            queue_size=snap["queued"],
            in_flight=snap["in_flight"],
            weight_sync_s=self.weight_sync_s,
            gen_tokens_per_s=(gen_tokens - self._last["gen_tokens"]) / dt,
        )
        if self.episodes is not None:
            row.update(self.episodes.stats.take())
        row.update(self.tracker.timeline.ratios(self._last["t_run"], self.tracker.elapsed()))
        self._last = {"time": now, "t_run": self.tracker.elapsed(), "gen_tokens": gen_tokens}
        row = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
        self.tracker.log_step(self.step, row)
        self.tracker.log_samples(
            self.step,
            [
                {
                    "group_id": g.group_id,
                    "data_index": g.data_index,
                    "min_version": g.min_version,
                    "completion": g.rollouts[0].text,
                    "reward": g.rollouts[0].reward,
                    "finish_reason": g.rollouts[0].finish_reason,
                }
                for g in groups
            ],
        )
        return row

    def accounting(self) -> dict[str, Any]:
        """Where every admitted group went; `admitted` equals the sum of the rest."""
        snap = self.buffer.snapshot()
        return {
            **snap,
            "failures": dict(self.orchestrator.failures),
            "engine_restarts": self.engine.restarts if self.engine is not None else 0,
        }

    def close(self) -> None:
        """Stop rollouts, the loop thread and the engine; safe to call twice."""
        self.orchestrator.stop()
        self.buffer.close()
        if self._rollouts is not None:
            try:  # let the dispatcher cancel its group tasks before counting
                self._rollouts.result(timeout=10)
            except Exception:
                pass
        (self.run_dir / "accounting.json").write_text(json.dumps(self.accounting(), indent=1))
        try:
            self.loop.run(self.transport.close(), timeout=5)
            self.loop.run(self.client.aclose(), timeout=5)
        except Exception:
            pass
        self.loop.stop()
        if self.engine is not None:
            self.engine.stop()
        if self.reward_runner is not None:
            self.reward_runner.close()
        self._wait_for_snapshot()
        self._snapshot_writer.shutdown()
        self.tracker.close()
