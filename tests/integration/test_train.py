"""End-to-end training on a tiny random model: equivalence, bounds, accounting, faults.

Each test runs the real pipeline (engine child process, HTTP, shm weight sync,
orchestrator, buffer, trainer) on a 2-layer model, so the whole suite costs a
few engine start-ups. What they check is what the pipeline promises:

- `max_staleness: 0` is synchronous on-policy GRPO: every trained token was
  sampled by the weights being trained, and the logged losses equal those of
  a plain reference loop written here (padded forward, loops for advantages
  and the loss, AdamW) fed with the same samples; two runs are identical.
- async mode keeps staleness within the bound and loses no group;
- a raising reward function, a killed engine, SIGTERM and kill -9 + resume all
  end as documented.
"""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from child_processes import children as descendants  # test_data_parallel imports it here
from safetensors.torch import load_file

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.learning.trainer import policy_trainer as trainer_loop
from asyncgrpo.testing import (
    engine_children,
    even_token_reward,
    failing_on_flag_reward,
    tiny_prompt_rows,
)


def base_config(tmp_path: Path, model_dir: Path, name: str, **overrides) -> dict:
    cfg = {
        "name": name,
        "output_dir": str(tmp_path),
        "seed": 3,
        "max_steps": 5,
        "eval_steps": 100,
        "checkpoint_steps": 2,
        "model": {"name_or_path": str(model_dir)},
        "engine": {"dtype": "float32", "num_threads": 1, "max_num_seqs": 16, "max_model_len": 128},
        "rollout": {"num_generations": 4, "max_tokens": 10, "filter_zero_variance": False},
        "coordinator": {"batch_groups": 2, "max_staleness": 0},
        # fp32 on every CPU: `auto` turns bf16 autocast on where bf16 is native, and the
        # equivalence test compares against an fp32 reference loop
        "trainer": {"learning_rate": 3e-3, "micro_batch_tokens": 96, "bf16_autocast": False},
    }
    for key, value in overrides.items():
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return cfg


def flat(cfg: dict) -> dict:
    """Nested dict -> dotted keys for AsyncGRPOConfig."""
    out = {}
    for key, value in cfg.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


class Recorder:
    """Wraps PolicyTrainer.step to keep a copy of every batch the trainer consumed."""

    def __init__(self, monkeypatch, on_step=None):
        self.batches: list[list] = []
        # wrap the real method even when an earlier Recorder of this test already wrapped it
        original = getattr(
            trainer_loop.PolicyTrainer.step, "unwrapped", trainer_loop.PolicyTrainer.step
        )
        recorder = self

        def step(trainer, groups):
            recorder.batches.append(copy.deepcopy(groups))
            if on_step is not None:
                on_step(len(recorder.batches))
            return original(trainer, groups)

        step.unwrapped = original
        monkeypatch.setattr(trainer_loop.PolicyTrainer, "step", step)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"]


def run_api(tmp_path, model_dir, name, rows, rewards, eval_rows=None, **overrides) -> Path:
    cfg = AsyncGRPOConfig(**flat(base_config(tmp_path, model_dir, name, **overrides)))
    trainer = AsyncGRPOTrainer(
        model=str(model_dir),
        reward_funcs=rewards,
        train_dataset=rows,
        eval_dataset=eval_rows,
        args=cfg,
    )
    return trainer.train()


# ---- the reference: synchronous GRPO in plain loops ------------------------------------


def reference_losses(model_dir: Path, batches: list[list], cfg: dict) -> tuple[list[float], dict]:
    """Replay the recorded batches through a deliberately simple synchronous GRPO loop.

    Checks on the way that each batch was sampled by the weights of that step
    (on-policy): the engine's log-probs equal this model's own log-probs.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    lr = cfg["trainer"]["learning_rate"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    cap = 2.0  # default correction cap (token_truncate)
    eps_low, eps_high = 0.2, 0.28
    losses = []
    for step, groups in enumerate(batches):
        rollouts, advantages = [], []
        for g in groups:
            rewards = [
                sum(t % 2 == 0 for t in r.completion_ids) / max(len(r.completion_ids), 1)
                for r in g.rollouts
            ]
            mean = sum(rewards) / len(rewards)
            std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / (len(rewards) - 1))
            for r, x in zip(g.rollouts, rewards, strict=True):
                assert set(r.versions) == {step}, "a token was not sampled by this step's weights"
                rollouts.append(r)
                advantages.append((x - mean) / (std + 1e-4))
        total_tokens = sum(len(r.completion_ids) for r in rollouts)
        loss = torch.zeros(())
        for r, adv in zip(rollouts, advantages, strict=True):
            ids = torch.tensor([r.prompt_ids + r.completion_ids])
            logits = model(ids).logits[0, :-1].float()
            logp_all = torch.log_softmax(logits, dim=-1)
            start = len(r.prompt_ids) - 1
            for j, token in enumerate(r.completion_ids):
                logp = logp_all[start + j, token]
                assert abs(logp.item() - r.logprobs[j]) < 1e-4, "engine log-prob is off-policy"
                ratio = torch.exp(logp - logp.detach())
                clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
                weight = min(math.exp(logp.item() - r.logprobs[j]), cap)
                loss = loss - weight * torch.minimum(ratio * adv, clipped * adv) / total_tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def test_synchronous_run_is_on_policy_grpo_and_deterministic(tmp_path, tiny_model_dir, monkeypatch):
    rows = tiny_prompt_rows(40)
    runs = []
    for name in ("a", "b"):
        recorder = Recorder(monkeypatch)
        run_dir = run_api(tmp_path, tiny_model_dir, name, rows, [even_token_reward])
        runs.append((recorder.batches, [r["loss"] for r in train_rows(run_dir)]))
    (batches_a, losses_a), (batches_b, losses_b) = runs
    assert len(batches_a) == len(losses_a) == 5
    tokens = [[r.completion_ids for g in b for r in g.rollouts] for b in batches_a]
    assert tokens == [[r.completion_ids for g in b for r in g.rollouts] for b in batches_b]
    assert losses_a == pytest.approx(losses_b, abs=1e-6)

    cfg = base_config(tmp_path, tiny_model_dir, "ref")
    expected, reference_weights = reference_losses(tiny_model_dir, batches_a, cfg)
    assert losses_a == pytest.approx(expected, abs=2e-5)
    assert any(abs(x) > 1e-4 for x in expected), "the test would not notice a wrong loss"
    # the updates match too, not just the loss values: final weights of run a vs the reference
    trained = load_file(tmp_path / "a" / "checkpoints" / "step-000005" / "model.safetensors")
    initial = load_file(tiny_model_dir / "model.safetensors")
    moved = 0
    for name, tensor in trained.items():
        # Adam divides by sqrt(v): float noise in near-zero gradients moves weights by up to
        # ~lr; a wrong loss (sign, weights, normalisation) moves them by O(lr) everywhere
        movement = (tensor - initial[name]).abs().max().item()
        assert (tensor - reference_weights[name]).abs().max().item() <= 0.01 * movement, name
        moved += movement > 0
    assert moved > len(trained) // 2, "training did not change the weights"


def test_async_run_bounds_staleness_and_accounts_for_every_group(
    tmp_path, tiny_model_dir, monkeypatch
):
    recorder = Recorder(monkeypatch)
    rows = tiny_prompt_rows(60, fail_every=5)
    run_dir = run_api(
        tmp_path,
        tiny_model_dir,
        "async",
        rows,
        [even_token_reward, failing_on_flag_reward],
        eval_rows=tiny_prompt_rows(5),
        max_steps=8,
        eval_steps=3,
        eval_limit=3,  # each evaluation scores the first 3 of the 5 held-out rows
        save_weights_steps=4,
        **{"coordinator.max_staleness": 2, "rollout.filter_zero_variance": True},
    )
    metrics = train_rows(run_dir)
    evals = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "eval"]
    # step 0 (the initial weights) and the final weights are always evaluated; an evaluation
    # still running when the next one falls due makes that one skip, so the middle may vary
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 8
    for e in evals:
        assert e["eval_count"] == 3
        # the weights that answered are the labelled step's or later ones: syncs may land
        # while an evaluation runs (on a loaded machine two landed during step 0's)
        assert e["step"] <= e["eval_weight_version_min"] <= e["eval_weight_version_max"] <= 8
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert all(m["staleness_max"] <= 2 for m in metrics)
    assert [m["version"] for m in metrics] == list(range(1, 9))
    for step, groups in enumerate(recorder.batches):
        for g in groups:
            assert step - g.min_version <= 2
            assert not g.row["fail"], "a group whose reward raised was trained"
    seen_versions = {v for b in recorder.batches for g in b for r in g.rollouts for v in r.versions}
    assert max(seen_versions) >= 4, "weights never reached the engine"

    acc = json.loads((run_dir / "accounting.json").read_text())
    assert acc["consumed"] == 8 * 2 == sum(len(b) for b in recorder.batches)
    assert acc["dropped"].get("reward_error", 0) >= 1
    assert acc["admitted"] == (
        acc["consumed"] + sum(acc["dropped"].values()) + acc["queued"] + acc["in_flight"]
    )
    trained_ids = [g.group_id for b in recorder.batches for g in b]
    assert len(trained_ids) == len(set(trained_ids))
    assert (run_dir / "checkpoints" / "latest").exists()
    snapshots = sorted(p.name for p in (run_dir / "weights").iterdir())
    assert snapshots == ["step-000004.safetensors", "step-000008.safetensors"]
    final = load_file(run_dir / "weights" / "step-000008.safetensors")
    checkpoint = load_file(run_dir / "checkpoints" / "step-000008" / "model.safetensors")
    assert final.keys() == checkpoint.keys()
    assert all(torch.equal(final[k], checkpoint[k]) for k in final)


@pytest.mark.heavy
def test_killed_engine_is_restarted_and_no_group_is_lost(tmp_path, tiny_model_dir, monkeypatch):
    killed = []

    def kill_engine(step: int) -> None:
        if step == 2 and not killed:
            for pid in engine_children():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

    recorder = Recorder(monkeypatch, on_step=kill_engine)
    run_dir = run_api(
        tmp_path,
        tiny_model_dir,
        "engine-kill",
        tiny_prompt_rows(40),
        [even_token_reward],
        max_steps=5,
        **{"coordinator.max_staleness": 1},
    )
    assert killed, "no engine child was found to kill"
    acc = json.loads((run_dir / "accounting.json").read_text())
    assert acc["engine_restarts"] == 1
    assert [m["step"] for m in train_rows(run_dir)] == [1, 2, 3, 4, 5]
    assert "generation_error" not in acc["failures"], acc
    assert acc["admitted"] == (
        acc["consumed"] + sum(acc["dropped"].values()) + acc["queued"] + acc["in_flight"]
    )
    ids = [g.group_id for b in recorder.batches for g in b]
    assert len(ids) == len(set(ids))
    assert engine_children() == []


# ---- the CLI in a child process: SIGTERM, kill -9 and --resume --------------------------


def write_recipe(tmp_path: Path, model_dir: Path, name: str, **overrides) -> Path:
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in tiny_prompt_rows(80)) + "\n")
    cfg = base_config(tmp_path, model_dir, name, **overrides)
    cfg["dataset"] = {"path": str(data), "eval_size": 4}
    cfg["rewards"] = ["asyncgrpo.testing:even_token_reward"]
    recipe = tmp_path / f"{name}.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    return recipe


def start_cli(*args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "asyncgrpo.cli", "train", *args],
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
    )


def wait_for(predicate, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"trainer exited early ({proc.returncode}):\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def checkpoint_step(run_dir: Path) -> int:
    latest = run_dir / "checkpoints" / "latest"
    if not latest.exists():
        return -1
    state = run_dir / "checkpoints" / latest.read_text().strip() / "state.json"
    return json.loads(state.read_text())["step"] if state.exists() else -1


@pytest.mark.heavy
def test_sigterm_checkpoints_and_exits_quickly(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path, tiny_model_dir, "term", max_steps=1000)
    run_dir, log = tmp_path / "term", tmp_path / "term.log"
    proc = start_cli(str(recipe), log=log)
    wait_for(lambda: checkpoint_step(run_dir) >= 2, 240, proc, log)
    children = descendants(proc.pid)
    assert children, "the engine child process was not found"
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=30)
    elapsed = time.monotonic() - sent
    assert code == 0, log.read_text()[-3000:]
    assert elapsed < 15, f"took {elapsed:.1f}s to stop"
    last_step = train_rows(run_dir)[-1]["step"]
    assert checkpoint_step(run_dir) == last_step
    time.sleep(0.5)
    assert not [p for p in children if Path(f"/proc/{p}").exists()], "engine not reaped"


@pytest.mark.heavy
def test_kill_9_then_resume_continues_from_the_checkpoint(tmp_path, tiny_model_dir):
    recipe = write_recipe(
        tmp_path, tiny_model_dir, "crash", max_steps=8, **{"coordinator.max_staleness": 1}
    )
    run_dir, log = tmp_path / "crash", tmp_path / "crash.log"
    proc = start_cli(str(recipe), log=log)
    wait_for(lambda: checkpoint_step(run_dir) >= 4, 240, proc, log)
    children = descendants(proc.pid)
    proc.kill()
    proc.wait()
    saved = checkpoint_step(run_dir)
    deadline = time.monotonic() + 10  # the orphaned engine notices its parent is gone
    while any(Path(f"/proc/{p}").exists() for p in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in children if Path(f"/proc/{p}").exists()], "orphaned engine"

    proc = start_cli("--resume", str(run_dir), log=log)
    assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["version"] for r in rows] == list(range(1, 9))
    state = json.loads(
        (run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip())
        .joinpath("state.json")
        .read_text()
    )
    assert state["step"] == 8 and saved >= 4
    samples = read_jsonl(run_dir / "samples.jsonl")
    positions = [s["group_id"] for s in samples]
    assert len(positions) == len(set(positions)), "a prompt was trained twice"


def test_a_build_that_fails_after_the_engine_started_stops_it(
    tmp_path, tiny_model_dir, monkeypatch
):
    """The engine starts before the trainer's model loads; a later error must not orphan it."""
    from asyncgrpo.base.config import RunConfig
    from asyncgrpo.run import build

    cfg = base_config(tmp_path, tiny_model_dir, "late-failure")
    cfg["dataset"] = {"builtin": "arithmetic", "size": 8}
    cfg["rewards"] = ["asyncgrpo.testing:even_token_reward"]

    def fail(*args, **kwargs):
        raise RuntimeError("the trainer could not be built")

    monkeypatch.setattr(build, "make_trainer", fail)
    with pytest.raises(RuntimeError, match="could not be built"):
        build.build_run(RunConfig.model_validate(cfg))
    assert engine_children() == []
