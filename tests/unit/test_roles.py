"""The run's roles behind their protocols, exercised with fakes only (no model, no HTTP).

- The top-level loop of `run.py` (`continuous_rollouts` + `continuous_training` over a
  `RunContext`) driven end to end by a fake `EngineBackend`, a fake `GroupBuilder` and
  a fake `Trainer`, with the real buffer, prompt stream, orchestrator, loop thread,
  evaluator, checkpointer and metric rows: the trainer gets `max_steps` full batches,
  weights are published at the configured versions and mode, staleness stays within
  the bound, no prompt position is trained twice, and the accounting closes.
- The orchestrator's outcome for each way a builder can end a group (dropped with a
  reason, reward failure under both policies, zero variance filtered or kept, an
  unexpected error, cancelled at shutdown): the quota and the prompt are released.
- `SingleTurnBuilder` resuming completions aborted by a weight sync from their own
  tokens, against a fake engine client.
- `is_zero_variance` deciding single-turn and episode groups alike.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncgrpo.backend.base import EngineBackend
from asyncgrpo.client.engine_client import Completion, Sample
from asyncgrpo.config import AdvantageConfig, RunConfig, build_config
from asyncgrpo.coordinator.buffer import RolloutBuffer
from asyncgrpo.metrics.tracker import MetricsTracker, read_metrics
from asyncgrpo.rollout.builder import GroupBuilder, GroupDropped, is_zero_variance
from asyncgrpo.rollout.orchestrator import Orchestrator
from asyncgrpo.rollout.prompts import PromptStream
from asyncgrpo.rollout.rewards import RewardFailure
from asyncgrpo.rollout.single_turn import SamplingSettings, SingleTurnBuilder
from asyncgrpo.rollout.types import Group, Rollout
from asyncgrpo.run import run_to_end
from asyncgrpo.run_context import RunContext
from asyncgrpo.trainer.base import Trainer
from asyncgrpo.trainer.checkpoint import Checkpointer, TrainingState, latest_checkpoint
from asyncgrpo.wiring import assemble_run

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

    async def build(self, group_id: int, position: int, row: dict) -> Group:
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
        group = Group(group_id, position, row, rollouts)
        group.zero_variance = is_zero_variance(rollouts, self.advantage)
        return group

    async def evaluate(self, rows: list[dict]) -> dict[str, Any]:
        return {"eval_reward_mean": 0.5, "eval_count": len(rows)}

    def take_stats(self) -> dict[str, Any]:
        return {"fake_groups_built": self.built}


class FakeTrainer:
    """A `Trainer` that records what each step consumed, at which version, and bumps it."""

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


def assemble(cfg: RunConfig, rows: list[dict]) -> RunContext:
    """A `RunContext` of fake roles and real plumbing, wired by `wiring.assemble_run`."""
    run_dir = Path(cfg.output_dir) / cfg.name
    engine, trainer = FakeEngine(), FakeTrainer()
    tracker = MetricsTracker(run_dir, overwrite=True)
    return assemble_run(cfg, run_dir, engine, trainer, FakeBuilder(engine), tracker, rows, None)


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

    # every trained group respects the staleness bound; no position is trained twice
    for version, groups in trainer.steps:
        for g in groups:
            assert 0 <= version - g.min_version <= cfg.coordinator.max_staleness
    positions = [g.data_index for _, groups in trainer.steps for g in groups]
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

    async def build(self, group_id: int, position: int, row: dict) -> Group:
        return await self._build(group_id, position, row)

    async def evaluate(self, rows: list[dict]) -> dict[str, Any]:
        return {}

    def take_stats(self) -> dict[str, Any]:
        return {}


def group_with_rewards(group_id: int, position: int, row: dict, rewards: list[float]) -> Group:
    rollouts = [
        Rollout([1], [2, 3], [-0.1, -0.2], [0, 0], "stop", "x", rewards=[r]) for r in rewards
    ]
    group = Group(group_id, position, row, rollouts)
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
    buffer = RolloutBuffer(batch_groups=1, max_staleness=0)
    prompts = PromptStream([{"prompt": "a"}, {"prompt": "b"}], seed=0)
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
    async def build(group_id, position, row):
        raise GroupDropped("prompt_too_long", "prompt of 300 tokens", log=False)

    async def scenario():
        orch = make_orchestrator(build)
        position = await produce_one(orch)
        assert_dropped(orch, position, "prompt_too_long")
        assert orch.fatal is None and not orch.stopping

    asyncio.run(scenario())


def test_reward_failure_under_abort_policy_stops_the_run():
    failure = RewardFailure("reward function raised")

    async def build(group_id, position, row):
        raise failure

    async def scenario():
        orch = make_orchestrator(build, on_reward_error="abort")
        position = await produce_one(orch)
        assert_dropped(orch, position, "reward_error")
        assert orch.fatal is failure and orch.stopping

    asyncio.run(scenario())


def test_reward_failure_under_drop_policy_only_drops_the_group():
    async def build(group_id, position, row):
        raise RewardFailure("reward function raised")

    async def scenario():
        orch = make_orchestrator(build, on_reward_error="drop_group")
        position = await produce_one(orch)
        assert_dropped(orch, position, "reward_error")
        assert orch.fatal is None and not orch.stopping

    asyncio.run(scenario())


def test_unexpected_builder_error_is_counted_as_generation_error():
    async def build(group_id, position, row):
        raise ConnectionError("engine went away")

    async def scenario():
        orch = make_orchestrator(build)
        position = await produce_one(orch)
        assert_dropped(orch, position, "generation_error")
        assert orch.fatal is None and not orch.stopping

    asyncio.run(scenario())


def test_zero_variance_group_is_dropped_when_filtering():
    async def build(group_id, position, row):
        return group_with_rewards(group_id, position, row, [1.0, 1.0])

    async def scenario():
        orch = make_orchestrator(build, filter_zero_variance=True)
        position = await produce_one(orch)
        assert_dropped(orch, position, "zero_variance")

    asyncio.run(scenario())


def test_zero_variance_group_is_queued_when_not_filtering():
    async def build(group_id, position, row):
        return group_with_rewards(group_id, position, row, [1.0, 1.0])

    async def scenario():
        orch = make_orchestrator(build, filter_zero_variance=False)
        position = await produce_one(orch)
        buffer = orch.buffer
        assert orch.failures == {} and buffer.dropped == {}
        assert buffer.snapshot()["queued"] == 1
        assert position in orch.prompts.pending  # pending until the trainer consumes it
        assert not buffer.wait_admit(0)  # its quota is held by the queued group
        (group,) = buffer.get_batch(trainer_version=0, timeout=1)
        assert group.zero_variance and group.data_index == position
        assert closes(buffer)

    asyncio.run(scenario())


def test_group_cancelled_at_shutdown_stays_counted_in_flight():
    async def scenario():
        running = asyncio.Event()

        async def build(group_id, position, row):
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
                Sample([10 * (i + 1), 10 * (i + 1) + 1], [-0.1, -0.2], [0, 0], "abort")
                for i in range(n)
            ]
        else:
            base = prompt_ids[-1] + 1  # continue from the sample's own last token
            samples = [Sample([base, base + 1, base + 2], [-0.3, -0.4, -0.5], [1, 1, 1], "stop")]
        return Completion(samples, list(prompt_ids))


class FakeRewards:
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
    group = asyncio.run(builder.build(group_id=3, position=7, row=row))
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

    assert (group.group_id, group.data_index, group.row) == (3, 7, row)
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
