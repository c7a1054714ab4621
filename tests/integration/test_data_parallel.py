"""Data-parallel training equals one process: 2 gloo ranks vs 1, for every aggregation.

Weights in float64: the log-prob kernels still compute in float32, and Adam's first
steps divide by the gradients' own size, so a float32 rounding difference in a
near-zero gradient (sums taken in another order) would move that weight by up to
~lr·1e-3 in float32 weights; with float64 weights the difference stays below 1e-6. Rank 0 is this test process (`wiring.make_trainer` with `trainer.num_processes: 2`
starts rank 1 as `python -m asyncgrpo.trainer.follower`); the reference is the
one-process `PolicyTrainer` on the same batches. Batches have groups of different
lengths and a micro-batch budget small enough that ranks run different numbers of
micro-batches.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
import yaml
from test_train import (
    checkpoint_step,
    descendants,
    start_cli,
    train_rows,
    wait_for,
    write_recipe,
)

from asyncgrpo.config import RunConfig
from asyncgrpo.rollout.types import Group, Rollout
from asyncgrpo.testing import save_tiny_model_dir
from asyncgrpo.trainer.build import load_policy, make_trainer, policy_trainer

AGGREGATIONS = ["grpo", "bnpo", "dr_grpo", "dapo"]


def config(
    tmp_path, model_dir, aggregation: str, processes: int, strategy="ddp", **sections
) -> RunConfig:
    """The test recipe; `sections` adds to its `loss` and `model` sections."""
    return RunConfig(
        name=f"dp-{aggregation}-{strategy}-{processes}",
        output_dir=str(tmp_path),
        model={"name_or_path": str(model_dir), **sections.get("model", {})},
        trainer={
            "num_processes": processes,
            "strategy": strategy,
            "learning_rate": 1e-2,
            "micro_batch_tokens": 48,
            "collective_timeout_s": 120,
            "bf16_autocast": False,
        },
        loss={"aggregation": aggregation, **sections.get("loss", {})},
        rollout={"num_generations": 3, "max_tokens": 12},
        rewards=["asyncgrpo.testing.even_token_reward"],
    )


def batches(seed: int = 0, steps: int = 3) -> list[list[Group]]:
    """Three batches of 5 groups: a long one (3 micro-batches, on rank 0) and four short
    ones (together 2 micro-batches, on rank 1), with unequal lengths throughout."""
    rng = random.Random(seed)
    out = []
    for step in range(steps):
        groups = []
        for g in range(5):
            long = g == 0
            prompt = [rng.randrange(3, 100) for _ in range(10 if long else rng.randint(2, 4))]
            rollouts = []
            for _ in range(3):
                size = rng.randint(32, 36) if long else rng.randint(1, 4)
                completion = [rng.randrange(3, 100) for _ in range(size)]
                rollouts.append(
                    Rollout(
                        prompt,
                        completion,
                        [-rng.uniform(0.5, 4.0) for _ in completion],
                        [step] * len(completion),
                        "length",
                        "",
                        rewards=[rng.choice([0.0, 0.5, 1.0])],
                    )
                )
            groups.append(Group(step * 10 + g, g, {}, rollouts))
        out.append(groups)
    return out


def train(trainer, data) -> list[dict]:
    return [trainer.step(groups) for groups in data]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_two_ranks_equal_one_process(tmp_path, aggregation, strategy):
    assert_two_ranks_equal_one_process(tmp_path, aggregation, strategy)


LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.mark.parametrize(
    "strategy, sections",
    [
        ("ddp", {"loss": {"beta": 0.1}}),
        ("fsdp", {"loss": {"beta": 0.1}}),
        ("ddp", {"model_lora": LORA}),
        ("fsdp", {"model_lora": LORA, "loss": {"beta": 0.1}}),
    ],
    ids=["ddp-kl", "fsdp-kl", "ddp-lora", "fsdp-lora-kl"],
)
def test_two_ranks_equal_one_process_with_kl_and_lora(tmp_path, strategy, sections):
    """The KL's reference (a copy, or the adapter switched off) and LoRA's adapter-only
    training and publishing are data parallel too."""
    sections = dict(sections)
    if "model_lora" in sections:
        sections["model_lora"] = {"lora": sections["model_lora"]}
    assert_two_ranks_equal_one_process(tmp_path, "dapo", strategy, **sections)


def assert_two_ranks_equal_one_process(tmp_path, aggregation, strategy, **sections):
    model_dir = save_tiny_model_dir(tmp_path / "model")
    extra = {"loss": sections.get("loss", {})}
    if "model_lora" in sections:
        extra["model"] = sections["model_lora"]
    single_cfg = config(tmp_path, model_dir, aggregation, 1, **extra)
    torch.manual_seed(0)
    single = policy_trainer(single_cfg, load_policy(single_cfg, str(model_dir)).double())
    initial = dict(single.named_weights())
    initial = {k: v.clone() for k, v in initial.items()}
    single_metrics = train(single, batches())

    cfg = config(tmp_path, model_dir, aggregation, 2, strategy, **extra)
    run_dir = tmp_path / cfg.name
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump()))
    torch.manual_seed(0)  # the same LoRA init (rank 1 gets rank 0's anyway)
    policy = load_policy(cfg, str(model_dir)).double()  # rank 1 follows rank 0's dtype
    parallel = make_trainer(cfg, policy, run_dir, str(model_dir))
    try:
        parallel_metrics = train(parallel, batches())
        weights = dict(parallel.named_weights())  # whole tensors, also when sharded
        local = [p for p in parallel.core.model.parameters() if hasattr(p, "device_mesh")]
        if strategy == "fsdp":  # each rank holds half of every weight matrix
            assert local and all(p.to_local().shape[0] * 2 >= p.shape[0] for p in local)
            assert sum(p.to_local().numel() for p in local) < sum(p.numel() for p in local)
        else:
            assert not local
    finally:
        parallel.close()

    assert parallel.version == single.version == 3
    published = dict(single.named_weights())
    assert weights.keys() == published.keys()
    moved = 0.0
    for name, one in published.items():
        torch.testing.assert_close(weights[name], one, atol=1e-6, rtol=0, msg=name)
        moved = max(moved, float((one - initial[name]).abs().max()))
    assert moved > 1e-3  # the steps did change the weights
    for a, b in zip(single_metrics, parallel_metrics, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-8)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
        if "kl" in a:
            assert b["kl"] == pytest.approx(a["kl"], abs=1e-8)
    if "beta" in extra["loss"]:
        assert single_metrics[-1]["kl"] > 0


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_two_process_run_survives_kill_9_of_a_rank_by_resuming(
    tmp_path, tiny_model_dir, strategy
):
    """`asyncgrpo train` with 2 ranks trains; kill -9 of rank 1 stops the job (exit 1, no
    process left behind) within the collective timeout; `--resume` finishes it (the fsdp
    run on one process: a checkpoint restores on any number of ranks)."""
    recipe = write_recipe(
        tmp_path,
        tiny_model_dir,
        "dp-run",
        max_steps=8,
        **{
            "trainer.num_processes": 2,
            "trainer.collective_timeout_s": 60,
            "trainer.strategy": strategy,
        },
    )
    run_dir, log = tmp_path / "dp-run", tmp_path / "dp-run.log"
    proc = start_cli(str(recipe), log=log)
    wait_for(lambda: checkpoint_step(run_dir) >= 2, 240, proc, log)
    assert [r["version"] for r in train_rows(run_dir)][:2] == [1, 2]
    children = descendants(proc.pid)
    ranks = [p for p in children if "asyncgrpo.trainer.follower" in cmdline(p)]
    assert len(ranks) == 1, [cmdline(p) for p in children]
    os.kill(ranks[0], signal.SIGKILL)
    killed = time.monotonic()
    assert proc.wait(timeout=60) == 1, log.read_text()[-3000:]
    assert time.monotonic() - killed < 60  # noticed before the collective timeout ran out
    assert "trainer rank 1 exited with code -9" in log.read_text()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{p}").exists() for p in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in children if Path(f"/proc/{p}").exists()], "a process was left behind"

    # the sharded checkpoint resumes on another number of ranks too
    ranks = ["--set", "trainer.num_processes=1"] if strategy == "fsdp" else []
    proc = start_cli("--resume", str(run_dir), *ranks, log=log)
    assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["version"] for r in rows] == list(range(1, 9))
    assert (run_dir / "trainer-rank1.log").exists()


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
