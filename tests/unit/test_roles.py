"""The run's roles behind their protocols, exercised with fakes only (no model, no HTTP).

- The top-level loop of `run/loop.py` (`continuous_rollouts` + `continuous_training` over a
  `RunContext`) driven end to end by a fake `EngineBackend`, a fake `GroupBuilder` and
  a fake `Trainer`, with the real buffer, prompt stream, orchestrator, loop thread,
  evaluator, checkpointer and metric rows: the trainer gets `max_steps` full batches,
  weights are published at the configured versions and mode, staleness stays within
  the bound, no prompt position is trained twice, and the accounting closes.
- The orchestrator's outcome for each way a builder can end a group (dropped with a
  reason, reward failure under both policies, zero variance filtered or kept, an
  unexpected error, cancelled at shutdown): the quota and the prompt are released.
- `SingleTurnBuilder` resuming completions aborted by a weight sync from their own
  tokens, against a fake engine client; a group whose rewards are all NaN dropped as
  `no_reward`.
- `is_zero_variance` deciding single-turn and episode groups alike.
- Faults around the loop: `accounting.json` written with every checkpoint and its
  counts carried across a crash and resume (the admission budget too); the watchdog
  naming what a stalled run waits for (a stuck reward call, an engine that does not
  answer) and the abort that follows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncgrpo.base.config import AdvantageConfig, RunConfig, build_config
from asyncgrpo.inference.backend.base import EngineBackend
from asyncgrpo.inference.client.engine_client import Completion, Continuation
from asyncgrpo.learning.coordinator.buffer import RolloutBuffer
from asyncgrpo.learning.metrics.tracker import MetricsTracker, read_metrics
from asyncgrpo.learning.rollout.advantages import is_zero_variance
from asyncgrpo.learning.rollout.builder import GroupBuilder, GroupDropped
from asyncgrpo.learning.rollout.orchestrator import Orchestrator
from asyncgrpo.learning.rollout.prompts import PromptStream
from asyncgrpo.learning.rollout.rewards import RewardFailure, RewardRunner, RewardTimeout
from asyncgrpo.learning.rollout.single_turn import SamplingSettings, SingleTurnBuilder
from asyncgrpo.learning.rollout.types import Group, Rollout
from asyncgrpo.learning.trainer.base import Trainer
from asyncgrpo.learning.trainer.checkpoint import Checkpointer, TrainingState, latest_checkpoint
from asyncgrpo.run.build import assemble_run
from asyncgrpo.run.context import RunContext
from asyncgrpo.run.loop import run_to_end
from asyncgrpo.run.session import RunAborted
from asyncgrpo.run.watchdog import Watchdog

# ---- fakes -----------------------------------------------------------------------------


def protocol_members(proto: type) -> set[str]:
    """Attributes and methods a protocol declares (what a fake must provide)."""
    names = set(getattr(proto, "__annotations__", {}))
    names |= {n for n in vars(proto) if not n.startswith("_")}
    return names


def assert_implements(obj: Any, proto: type) -> None:
    missing = sorted(n for n in protocol_members(proto) if not hasattr(obj, n))
    assert not missing, f"{type(obj).__name__} lacks {proto.__name__} members {missing}"


class FakeClient:
    """The part of `EngineClient` the producer touches: `server_info` for the busy timeline."""

    async def server_info(self) -> dict:
        return {"stats": {}}


class FakeEngine:
    """An `EngineBackend` that records every weight sync; its version is the last one sent."""

    def __init__(self) -> None:
        self.client = FakeClient()
        self.restarts = 0
        self.sync_timings: dict[str, float] = {}
        self.version = 0
        self.syncs: list[tuple[int, str]] = []  # (version, mode) of every sync_weights call
        self.synced_weights: list[dict[str, torch.Tensor]] = []
        self.layout: list | None = None
        self.closed = False

    @property
    def base_urls(self) -> list[str]:
        return ["http://fake-engine"]

    def launch(self) -> None:
        pass

    async def wait_ready(self, layout=None) -> None:
        self.layout = list(layout) if layout is not None else None

    async def healthy(self) -> bool:
        return True

    async def revive(self) -> bool:
        return False

    async def sync_weights(self, weights, version: int, mode: str) -> None:
        self.syncs.append((version, mode))
        self.synced_weights.append({name: t.clone() for name, t in weights})
        self.version = version
        self.sync_timings = {"pause_s": 0.001 * version}

    async def close(self) -> None:
        self.closed = True


class FakeBuilder:
    """A `GroupBuilder` whose groups carry the fake engine's version at start and end."""

    def __init__(self, engine: FakeEngine, delay_s: float = 0.002) -> None:
        self.engine = engine
        self.delay_s = delay_s
        self.generated_tokens = 0
        self.built = 0
        self.advantage = AdvantageConfig()

    async def build(self, group_id: int, row: dict) -> Group:
        start = self.engine.version
        await asyncio.sleep(self.delay_s)  # "generation": a sync may land meanwhile
        end = self.engine.version
        rollouts = [
            Rollout(
                prompt_ids=[1, 2],
                completion_ids=[3, 4],
                logprobs=[-0.5, -0.25],
                versions=[start, end],
                finish_reason="stop",
                text=f"{row['prompt']} answer {i}",
                rewards=[float(i)],  # distinct rewards: the group carries a signal
            )
            for i in range(2)
        ]
        self.generated_tokens += sum(len(r.completion_ids) for r in rollouts)
        self.built += 1
        group = Group(group_id, row, rollouts)
        group.zero_variance = is_zero_variance(rollouts, self.advantage)
        return group

    async def evaluate(self, rows: list[dict]) -> dict[str, Any]:
        return {"eval_reward_mean": 0.5, "eval_count": len(rows)}

    def take_stats(self) -> dict[str, Any]:
        return {"fake_groups_built": self.built}


class FakeTrainer:
    """A `Trainer` that records what each step consumed, at which version, and bumps it."""

    gathers_weights = False

    def __init__(self) -> None:
        self.version = 0
        self.weight = torch.arange(4, dtype=torch.float32)
        self.steps: list[tuple[int, list[Group]]] = []  # (version when consumed, groups)

    def step(self, groups: list[Group]) -> dict[str, float]:
        self.steps.append((self.version, list(groups)))
        self.version += 1
        self.weight = self.weight + 1.0
        rewards = [r.rewards[0] for g in groups for r in g.rollouts]
        return {"loss": 0.0, "reward_mean": sum(rewards) / len(rewards)}

    def named_weights(self, dtype: torch.dtype | None = None):
        yield "w", self.weight if dtype is None else self.weight.to(dtype)

    def save_checkpoint(self, directory: Path, state: TrainingState) -> Path:
        path = Path(directory) / f"step-{state.step:06d}"
        path.mkdir(parents=True, exist_ok=True)
        (path / "state.json").write_text(json.dumps(dataclasses.asdict(state)))
        (Path(directory) / "latest").write_text(path.name)
        return path

    def load_checkpoint(self, path: Path) -> TrainingState:
        state = TrainingState(**json.loads((Path(path) / "state.json").read_text()))
        self.version = state.version
        return state

    def close(self) -> None:
        self.closed = True


def test_fakes_provide_every_protocol_member():
    engine = FakeEngine()
    assert_implements(engine, EngineBackend)
    assert_implements(FakeBuilder(engine), GroupBuilder)
    assert_implements(FakeTrainer(), Trainer)


# ---- the top-level loop ----------------------------------------------------------------


def run_config(tmp_path: Path, **coordinator: Any) -> RunConfig:
    return build_config(
        {
            "name": "fake",
            "output_dir": str(tmp_path),
            "max_steps": 4,
            "checkpoint_steps": 2,
            "rollout": {"request_timeout_s": 5},
            "coordinator": {"batch_groups": 2, "max_staleness": 1, **coordinator},
        }
    )


def assemble(cfg: RunConfig, rows: list[dict], resume: bool = False, **kw: Any) -> RunContext:
    """A `RunContext` of fake roles and real plumbing, wired by `run/build.py`'s `assemble_run`;
    `engine=` another fake engine, `builder=` a factory of the builder from the engine,
    `rewards=` a `RewardRunner`."""
    run_dir = Path(cfg.output_dir) / cfg.name
    engine, trainer = kw.pop("engine", None) or FakeEngine(), FakeTrainer()
    builder = kw.pop("builder", FakeBuilder)(engine)
    tracker = MetricsTracker(run_dir, overwrite=not resume)
    return assemble_run(cfg, run_dir, engine, trainer, builder, tracker, rows, None, **kw)


def train_like_run_train(r: RunContext) -> None:
    """What `run.train` does after `build_run`."""
    run_to_end(r, threading.Event())


@pytest.mark.parametrize(
    ("weight_sync_steps", "sync_mode", "max_ahead_batches"),
    [(1, "keep", 1.0), (2, "abort", 1.0), (1, "wait", None)],
    ids=["sync-every-step", "sync-every-2-abort", "staleness-bound-alone"],
)
def test_run_loop_with_fake_roles_trains_max_steps_within_bounds(
    tmp_path, weight_sync_steps, sync_mode, max_ahead_batches
):
    cfg = run_config(
        tmp_path,
        weight_sync_steps=weight_sync_steps,
        sync_mode=sync_mode,
        max_ahead_batches=max_ahead_batches,
    )
    rows = [{"prompt": f"p{i}"} for i in range(5)]  # fewer rows than groups: epochs wrap
    r = assemble(cfg, rows)
    engine, trainer = r.engine, r.trainer
    started = time.monotonic()
    train_like_run_train(r)
    assert time.monotonic() - started < 10

    # the trainer consumed max_steps batches of batch_groups groups
    max_steps, batch = cfg.max_steps, cfg.coordinator.batch_groups
    assert trainer.version == max_steps
    assert [len(groups) for _, groups in trainer.steps] == [batch] * max_steps
    assert [v for v, _ in trainer.steps] == list(range(max_steps))

    # weights went out at version 0, then at every multiple of weight_sync_steps, in the mode
    expected = [0] + [s for s in range(1, max_steps + 1) if s % weight_sync_steps == 0]
    assert [v for v, _ in engine.syncs] == expected
    assert {mode for _, mode in engine.syncs} == {sync_mode}
    assert [w["w"].tolist() for w in engine.synced_weights] == [
        [float(v + i) for i in range(4)] for v in expected
    ]
    assert engine.layout is not None and engine.closed
    # each step's row carries the pause time of the engine's latest sync that landed: the
    # one of this step, or (still landing when the row was written) the one before
    logged = [json.loads(line) for line in (r.run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in logged:
        landed = [0.001 * v for v in expected if v <= row["step"]][-2:]
        assert row["engine_pause_s"] in landed

    # every trained group respects the staleness bound; no position is trained twice
    for version, groups in trainer.steps:
        for g in groups:
            assert 0 <= version - g.min_version <= cfg.coordinator.max_staleness
    positions = [g.group_id for _, groups in trainer.steps for g in groups]
    assert len(positions) == len(set(positions))

    # where every admitted group went
    acc = json.loads((r.run_dir / "accounting.json").read_text())
    assert acc["consumed"] == max_steps * batch
    assert acc["admitted"] == (
        acc["consumed"] + sum(acc["dropped"].values()) + acc["queued"] + acc["in_flight"]
    )
    assert acc["failures"] == {} and acc["engine_restarts"] == 0
    # the admission throttle already keeps groups fresh: none had to be dropped as stale
    assert acc["dropped"] == {}

    # one metric row per step, carrying the builder's stats and the staleness seen
    train_rows, _ = read_metrics(r.run_dir)
    assert [row["step"] for row in train_rows] == list(range(1, max_steps + 1))
    assert all(row["staleness_max"] <= cfg.coordinator.max_staleness for row in train_rows)
    assert all(row["fake_groups_built"] >= 2 for row in train_rows)

    # the final checkpoint went through the trainer's own save, and restores
    assert latest_checkpoint(r.run_dir / "checkpoints").name == f"step-{max_steps:06d}"
    fresh = FakeTrainer()
    resumer = Checkpointer(fresh, r.run_dir, 1, None, torch.float32)
    state = resumer.resume()
    resumer.close()
    assert fresh.version == max_steps and state.step == max_steps
    assert state.data_position["cursor"] >= max_steps * batch
    assert not set(positions) & set(state.data_position["pending"])  # trained: not served again


# ---- the orchestrator's outcomes -------------------------------------------------------


class ScriptedBuilder:
    """A `GroupBuilder` whose `build` runs a given coroutine function."""

    def __init__(self, build) -> None:
        self._build = build
        self.generated_tokens = 0

    async def build(self, group_id: int, row: dict) -> Group:
        return await self._build(group_id, row)

    async def evaluate(self, rows: list[dict]) -> dict[str, Any]:
        return {}

    def take_stats(self) -> dict[str, Any]:
        return {}


def group_with_rewards(group_id: int, row: dict, rewards: list[float]) -> Group:
    rollouts = [
        Rollout([1], [2, 3], [-0.1, -0.2], [0, 0], "stop", "x", rewards=[r]) for r in rewards
    ]
    group = Group(group_id, row, rollouts)
    group.zero_variance = is_zero_variance(rollouts, AdvantageConfig())
    return group


def closes(buffer: RolloutBuffer) -> bool:
    s = buffer.snapshot()
    return (
        s["admitted"] == s["consumed"] + sum(s["dropped"].values()) + s["queued"] + s["in_flight"]
    )


async def produce_one(orchestrator: Orchestrator, timeout_s: float = 2.0) -> int:
    """Admit one group, start it, wait until it left `in_flight`; its position."""
    buffer, prompts = orchestrator.buffer, orchestrator.prompts
    assert buffer.wait_admit(0)
    position, row = prompts.next()
    orchestrator.start_group(position, row)
    deadline = time.monotonic() + timeout_s
    while buffer.in_flight:
        assert time.monotonic() < deadline, "the group never left in_flight"
        await asyncio.sleep(0.001)
    return position


def make_orchestrator(build, **kw) -> Orchestrator:
    # one group of budget: a second admission succeeds only if the first released its quota
    prompts = PromptStream([{"prompt": "a"}, {"prompt": "b"}], seed=0)
    buffer = RolloutBuffer(batch_groups=1, max_staleness=0, on_group_end=prompts.done)
    return Orchestrator(ScriptedBuilder(build), buffer, prompts, **kw)


def assert_dropped(orchestrator: Orchestrator, position: int, reason: str) -> None:
    buffer = orchestrator.buffer
    assert orchestrator.failures == {reason: 1}
    assert buffer.dropped == {reason: 1}
    assert buffer.in_flight == 0 and buffer.snapshot()["queued"] == 0
    assert position not in orchestrator.prompts.pending  # never served again
    assert buffer.wait_admit(0)  # the quota came back at once
    assert closes(buffer)


def test_group_dropped_by_the_builder_is_counted_under_its_reason():
    async def build(group_id, row):
        raise GroupDropped("prompt_too_long", "prompt of 300 tokens", log=False)

    async def scenario():
        orch = make_orchestrator(build)
        position = await produce_one(orch)
        assert_dropped(orch, position, "prompt_too_long")
        assert orch.fatal is None and not orch.stopping

    asyncio.run(scenario())


def test_reward_failure_under_abort_policy_stops_the_run():
    failure = RewardFailure("reward function raised")

    async def build(group_id, row):
        raise failure

    async def scenario():
        orch = make_orchestrator(build, on_reward_error="abort")
        position = await produce_one(orch)
        assert_dropped(orch, position, "reward_error")
        assert orch.fatal is failure and orch.stopping

    asyncio.run(scenario())


def test_reward_failure_under_drop_policy_only_drops_the_group():
    async def build(group_id, row):
        raise RewardFailure("reward function raised")

    async def scenario():
        orch = make_orchestrator(build, on_reward_error="drop_group")
        position = await produce_one(orch)
        assert_dropped(orch, position, "reward_error")
        assert orch.fatal is None and not orch.stopping

    asyncio.run(scenario())


@pytest.mark.parametrize("policy", ["drop_group", "abort"])
def test_reward_timeout_is_counted_under_its_own_reason(policy):
    timeout = RewardTimeout("reward function 'judge' did not return within 60 s")

    async def build(group_id, row):
        raise timeout

    async def scenario():
        orch = make_orchestrator(build, on_reward_error=policy)
        position = await produce_one(orch)
        assert_dropped(orch, position, "reward_timeout")
        assert (orch.fatal is timeout) == (policy == "abort") == orch.stopping

    asyncio.run(scenario())


def test_unexpected_builder_error_is_counted_as_generation_error():
    async def build(group_id, row):
        raise ConnectionError("engine went away")

    async def scenario():
        orch = make_orchestrator(build)
        position = await produce_one(orch)
        assert_dropped(orch, position, "generation_error")
        assert orch.fatal is None and not orch.stopping

    asyncio.run(scenario())


def test_zero_variance_group_is_dropped_when_filtering():
    async def build(group_id, row):
        return group_with_rewards(group_id, row, [1.0, 1.0])

    async def scenario():
        orch = make_orchestrator(build, filter_zero_variance=True)
        position = await produce_one(orch)
        assert_dropped(orch, position, "zero_variance")

    asyncio.run(scenario())


def test_zero_variance_group_is_queued_when_not_filtering():
    async def build(group_id, row):
        return group_with_rewards(group_id, row, [1.0, 1.0])

    async def scenario():
        orch = make_orchestrator(build, filter_zero_variance=False)
        position = await produce_one(orch)
        buffer = orch.buffer
        assert orch.failures == {} and buffer.dropped == {}
        assert buffer.snapshot()["queued"] == 1
        assert position in orch.prompts.pending  # pending until the trainer consumes it
        assert not buffer.wait_admit(0)  # its quota is held by the queued group
        (group,) = buffer.get_batch(trainer_version=0, timeout=1)
        assert group.zero_variance and group.group_id == position
        assert closes(buffer)

    asyncio.run(scenario())


def test_group_cancelled_at_shutdown_stays_counted_in_flight():
    async def scenario():
        running = asyncio.Event()

        async def build(group_id, row):
            running.set()
            await asyncio.sleep(60)

        orch = make_orchestrator(build)
        assert orch.buffer.wait_admit(0)
        position, row = orch.prompts.next()
        orch.start_group(position, row)
        await asyncio.wait_for(running.wait(), 2)
        orch.stop()
        await asyncio.wait_for(orch.drain(), 2)
        snap = orch.buffer.snapshot()
        assert snap["in_flight"] == 1 and snap["dropped"] == {} and orch.failures == {}
        assert position in orch.prompts.pending  # a resume serves it again
        assert closes(orch.buffer)

    asyncio.run(scenario())


# ---- single-turn groups resumed after an abort -----------------------------------------


class FakeTokenizer:
    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        assert add_special_tokens is False  # plain-string prompts are used as is
        return {"input_ids": [100 + ord(c) for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(str(i) for i in ids)


class AbortingClient:
    """First call: `n` samples aborted by a sync after 2 tokens (version 0); each
    continuation: the rest of that sample (3 tokens, version 1), finished."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    async def complete(self, prompt_ids, *, n=1, max_tokens=16, **sampling) -> Completion:
        self.calls.append(
            {"prompt_ids": list(prompt_ids), "n": n, "max_tokens": max_tokens, **sampling}
        )
        if len(self.calls) == 1:
            samples = [
                Continuation([10 * (i + 1), 10 * (i + 1) + 1], [-0.1, -0.2], [0, 0], "abort")
                for i in range(n)
            ]
        else:
            base = prompt_ids[-1] + 1  # continue from the sample's own last token
            samples = [
                Continuation([base, base + 1, base + 2], [-0.3, -0.4, -0.5], [1, 1, 1], "stop")
            ]
        return Completion(samples, list(prompt_ids))


class FakeRewards:
    names = ["index"]  # one reward function: each completion's position

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def score_group(self, row, texts, ids) -> list[list[float]]:
        self.calls.append((row, list(texts), [list(x) for x in ids]))
        return [[float(i) for i in range(len(texts))]]  # one reward function


def test_single_turn_resumes_aborted_samples_from_their_own_tokens():
    client, rewards = AbortingClient(), FakeRewards()
    sampling = SamplingSettings(n=2, max_tokens=6, temperature=0.7, top_p=0.9)
    builder = SingleTurnBuilder(client, FakeTokenizer(), rewards, sampling, AdvantageConfig())
    row = {"prompt": "ab", "answer": "x"}
    group = asyncio.run(builder.build(group_id=3, row=row))
    prompt = [100 + ord("a"), 100 + ord("b")]

    first, *continuations = client.calls
    assert first == {
        "prompt_ids": prompt,
        "n": 2,
        "max_tokens": 6,
        "temperature": 0.7,
        "top_p": 0.9,
    }
    assert len(continuations) == 2  # one per aborted sample
    for i, call in enumerate(continuations):
        partial = [10 * (i + 1), 10 * (i + 1) + 1]
        assert call["prompt_ids"] == prompt + partial  # original prompt + partial ids
        assert call["n"] == 1
        assert call["max_tokens"] == 6 - 2  # reduced by the tokens already generated
        assert (call["temperature"], call["top_p"]) == (0.7, 0.9)

    assert (group.group_id, group.row) == (3, row)
    for i, rollout in enumerate(group.rollouts):
        partial = [10 * (i + 1), 10 * (i + 1) + 1]
        rest = [partial[-1] + 1, partial[-1] + 2, partial[-1] + 3]
        assert rollout.prompt_ids == prompt  # the rollout keeps the original prompt
        assert rollout.completion_ids == partial + rest
        assert rollout.versions == [0, 0, 1, 1, 1]
        assert rollout.logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5]
        assert rollout.finish_reason == "stop"
        assert rollout.text == " ".join(str(t) for t in partial + rest)
        assert rollout.rewards == [float(i)]
    assert group.min_version == 0
    assert builder.generated_tokens == 2 * 5  # each sampled token counted once
    assert not group.zero_variance
    assert rewards.calls == [
        (row, [r.text for r in group.rollouts], [r.completion_ids for r in group.rollouts])
    ]


class AnsweringClient:
    """Every call: `n` finished samples of two tokens."""

    async def complete(self, prompt_ids, *, n=1, max_tokens=16, **sampling) -> Completion:
        return Completion(
            [Continuation([5, 6], [-0.1, -0.2], [0, 0], "stop")] * n, list(prompt_ids)
        )


def nan_reward(prompts, completions, **kw):
    return [float("nan")] * len(completions)


def test_a_group_without_any_reward_is_dropped_as_no_reward_not_zero_variance(caplog):
    rewards = RewardRunner([nan_reward])
    sampling = SamplingSettings(n=3, max_tokens=4, temperature=1.0)
    builder = SingleTurnBuilder(
        AnsweringClient(), FakeTokenizer(), rewards, sampling, AdvantageConfig()
    )

    async def scenario():
        prompts = PromptStream([{"prompt": "a"}, {"prompt": "b"}], seed=0)
        buffer = RolloutBuffer(batch_groups=1, max_staleness=0, on_group_end=prompts.done)
        orch = Orchestrator(builder, buffer, prompts, filter_zero_variance=True)
        assert_dropped(orch, await produce_one(orch), "no_reward")

    with caplog.at_level(logging.ERROR, logger="asyncgrpo.learning.rollout.orchestrator"):
        asyncio.run(scenario())
    assert "None or NaN for 3 of 3 completions" in caplog.text
    assert "None/NaN for all: nan_reward" in caplog.text


# ---- zero variance, one rule for both builders -----------------------------------------


def single_turn_rollouts(rewards: list[list[float]]) -> list[Rollout]:
    return [Rollout([1], [2], [-0.1], [0], "stop", "t", rewards=list(r)) for r in rewards]


def episode_rollouts(rewards: list[float]) -> list[Rollout]:
    # episodes: template tokens inside the completion are masked (version -1), one reward each
    return [
        Rollout(
            [1],
            [2, 3, 4],
            [-0.1, 0.0, -0.2],
            [0, -1, 0],
            "stop",
            "t",
            [r],
            completion_mask=[1, 0, 1],
        )
        for r in rewards
    ]


@pytest.mark.parametrize(
    ("rollouts", "expected"),
    [
        (single_turn_rollouts([[1.0, 0.5], [1.0, 0.5], [1.0, 0.5]]), True),
        (single_turn_rollouts([[1.0, 0.5], [0.0, 0.5], [1.0, 0.5]]), False),
        (episode_rollouts([0.25, 0.25, 0.25]), True),
        (episode_rollouts([0.25, 1.0, 0.25]), False),
    ],
    ids=["single-turn-equal", "single-turn-different", "episodes-equal", "episodes-different"],
)
def test_zero_variance_is_equal_rewards_for_single_turn_and_episodes(rollouts, expected):
    assert is_zero_variance(rollouts, AdvantageConfig()) is expected


# ---- faults around the loop: accounting across a crash, the watchdog -------------------


class Crash(Exception):
    """Stands for the process dying in the middle of a step."""


def test_accounting_is_written_with_each_checkpoint_and_continues_after_a_resume(tmp_path):
    cfg = run_config(tmp_path, max_ahead_batches=None)  # the staleness budget alone admits
    rows = [{"prompt": f"p{i}"} for i in range(7)]
    first = assemble(cfg, rows)
    at_crash = []
    step = first.trainer.step

    def crash_in_step_3(groups):
        if first.trainer.version == 2:  # checkpoint_steps 2: step 2 was checkpointed
            at_crash.append(json.loads((first.run_dir / "accounting.json").read_text()))
            raise Crash
        return step(groups)

    first.trainer.step = crash_in_step_3
    with pytest.raises(Crash):
        train_like_run_train(first)
    # the file existed before the crash, as of the checkpoint (it was written at exit only)
    assert [a["consumed"] for a in at_crash] == [4]

    cfg = cfg.model_copy(update={"max_steps": 6})
    second = assemble(cfg, rows, resume=True)
    run_to_end(second, threading.Event(), resume=True)
    trained = [g for _, groups in second.trainer.steps for g in groups]
    assert [v for v, _ in second.trainer.steps] == [2, 3, 4, 5]

    acc = json.loads((second.run_dir / "accounting.json").read_text())
    batch = cfg.coordinator.batch_groups
    assert acc["consumed"] == 2 * batch + len(trained) == 6 * batch  # both sessions
    assert acc["admitted"] == (
        acc["consumed"] + sum(acc["dropped"].values()) + acc["queued"] + acc["in_flight"]
    )
    # the admission budget continued from the trained total: nothing was admitted too early
    assert acc["dropped"].get("stale", 0) == 0
    for version, groups in second.trainer.steps:
        assert all(version - g.min_version <= cfg.coordinator.max_staleness for g in groups)


class StalledEngine(FakeEngine):
    async def healthy(self) -> bool:
        return False


def stuck_reward(release: threading.Event):
    def blocked_reward(prompts, completions, **kw):
        release.wait(60)
        return [0.0] * len(completions)

    return blocked_reward


@pytest.mark.parametrize(
    "stall",
    ["reward", pytest.param("engine", marks=pytest.mark.heavy)],  # second run: heavy
)
def test_watchdog_names_what_a_stalled_run_waits_for(tmp_path, caplog, stall):
    release = threading.Event()
    rewards = RewardRunner([stuck_reward(release)], timeout_s=60)

    class Builder(FakeBuilder):
        async def build(self, group_id, row):
            group = await super().build(group_id, row)
            if stall == "engine":
                await asyncio.Event().wait()  # generation never answers
            texts = [r.text for r in group.rollouts]
            await rewards.score_group(row, texts, [r.completion_ids for r in group.rollouts])
            return group

    cfg = run_config(tmp_path, watchdog_s=0.5)
    cfg.rollout.request_timeout_s = 4
    engine = StalledEngine() if stall == "engine" else FakeEngine()
    r = assemble(cfg, [{"prompt": "p"}], engine=engine, builder=Builder, rewards=rewards)
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.run.watchdog"):
        try:
            with pytest.raises(RunAborted) as aborted:
                train_like_run_train(r)
        finally:
            release.set()
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "asyncgrpo.run.watchdog"]
    assert len(lines) >= 2, "the watchdog did not repeat while the run stalled"
    assert all(line.startswith("nothing has progressed for") for line in lines)
    assert "trainer: waiting for a batch" in lines[-1]
    assert "building 2 groups, the oldest for" in lines[-1]
    if stall == "reward":
        assert "reward calls: 'blocked_reward'" in lines[-1]
        assert "engine: healthy" in lines[-1]
    else:
        assert "engine: not answering its health check" in lines[-1]
        assert "reward calls: none" in lines[-1]
    message = str(aborted.value)
    assert message.startswith("no batch within 4 s (rollout.request_timeout_s)")
    assert ("'blocked_reward'" in message) == (stall == "reward")


def test_watchdog_reports_once_per_period_while_stalled_and_rearms_on_progress():
    now, mark, reports = [0.0], ["a"], []

    def report() -> str:
        reports.append(now[0])
        return "waiting"

    dog = Watchdog(10.0, lambda: mark[0], report, clock=lambda: now[0])
    for t in (0.0, 5.0, 9.9, 10.0, 15.0, 20.0, 21.0):
        now[0] = t
        dog.check()
    assert reports == [10.0, 20.0]
    mark[0] = "b"  # progress
    for t in (25.0, 34.0, 35.0):
        now[0] = t
        line = dog.check()
    assert reports == [10.0, 20.0, 35.0]
    assert line == "nothing has progressed for 10 s | waiting"
