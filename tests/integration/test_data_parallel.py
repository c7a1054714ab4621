"""Data-parallel training equals one process: 2 gloo ranks vs 1, for every aggregation.

Weights in float64: the log-prob kernels still compute in float32, and Adam's first
steps divide by the gradients' own size, so a float32 rounding difference in a
near-zero gradient (sums taken in another order) would move that weight by up to
~lr·1e-3 in float32 weights; with float64 weights the difference stays below 1e-6. Rank 0 is this test process (`run/build.py`'s `make_trainer` with `trainer.num_processes: 2`
starts rank 1 as `python -m asyncgrpo.learning.trainer.follower`); the reference is the
one-process `PolicyTrainer` on the same batches. Batches have groups of different
lengths and a micro-batch budget small enough that ranks run different numbers of
micro-batches. Also here: a checkpoint restores into a sharded trainer exactly, and
`asyncgrpo train` runs with 2 ranks (started by rank 0, or by torchrun), survives
kill -9 of a rank and resumes, and stops within the collective timeout when a rank hangs.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_train import (
    checkpoint_step,
    descendants,
    start_cli,
    train_rows,
    wait_for,
    write_recipe,
)

from asyncgrpo.base.config import RunConfig
from asyncgrpo.learning.rollout.types import Group, Rollout
from asyncgrpo.learning.trainer.build import load_policy, make_trainer, policy_trainer
from asyncgrpo.learning.trainer.checkpoint import TrainingState
from asyncgrpo.testing import save_tiny_model_dir

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
            groups.append(Group(step * 10 + g, {}, rollouts))
        out.append(groups)
    return out


def train(trainer, data) -> list[dict]:
    return [trainer.step(groups) for groups in data]


def single_trainer(cfg: RunConfig, model_dir: Path):
    """The one-process `PolicyTrainer` of `cfg`, on float64 weights."""
    return policy_trainer(cfg, load_policy(cfg, str(model_dir)).double())


def parallel_trainer(cfg: RunConfig, model_dir: Path, run_dir: Path):
    """Rank 0 of `cfg`'s ranks (this process; the others are follower processes reading
    `run_dir/config.yaml`), on float64 weights: rank 1 follows rank 0's dtype."""
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump()))
    policy = load_policy(cfg, str(model_dir)).double()
    return make_trainer(cfg, policy, run_dir, str(model_dir))


# one pairing per strategy in `make test`; the other six under `make test-heavy`
QUICK_PAIRINGS = {("grpo", "ddp"), ("dapo", "fsdp")}


@pytest.mark.parametrize(
    "aggregation, strategy",
    [
        pytest.param(
            aggregation,
            strategy,
            id=f"{aggregation}-{strategy}",
            marks=() if (aggregation, strategy) in QUICK_PAIRINGS else pytest.mark.heavy,
        )
        for strategy in ("ddp", "fsdp")
        for aggregation in AGGREGATIONS
    ],
)
def test_two_ranks_equal_one_process(tmp_path, aggregation, strategy):
    assert_two_ranks_equal_one_process(tmp_path, aggregation, strategy)


LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.mark.heavy
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


@pytest.mark.parametrize(
    "strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.heavy)], ids=["ddp", "fsdp"]
)
def test_two_ranks_share_the_whole_step_m2_mask(tmp_path, strategy):
    """`trust_region: m2` masks by the whole step's squared log-ratios: each rank gathers
    every rank's, so 2 ranks mask, train and log M2 as one process (τ = 8 masks about
    half the tokens of these batches: the tiny model is far from their log-probs)."""
    m2 = {"trust_region": "m2", "m2_threshold": 8.0}
    assert_two_ranks_equal_one_process(tmp_path, "dapo", strategy, loss=m2)


def assert_two_ranks_equal_one_process(tmp_path, aggregation, strategy, **sections):
    model_dir = save_tiny_model_dir(tmp_path / "model")
    extra = {"loss": sections.get("loss", {})}
    if "model_lora" in sections:
        extra["model"] = sections["model_lora"]
    single_cfg = config(tmp_path, model_dir, aggregation, 1, **extra)
    torch.manual_seed(0)
    single = single_trainer(single_cfg, model_dir)
    initial = dict(single.named_weights())
    initial = {k: v.clone() for k, v in initial.items()}
    single_metrics = train(single, batches())

    cfg = config(tmp_path, model_dir, aggregation, 2, strategy, **extra)
    torch.manual_seed(0)  # the same LoRA init (rank 1 gets rank 0's anyway)
    parallel = parallel_trainer(cfg, model_dir, tmp_path / cfg.name)
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
        for key in ("m2_before", "m2_after", "m2_masked_fraction"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-9), key
    if "beta" in extra["loss"]:
        assert single_metrics[-1]["kl"] > 0
    if "trust_region" in extra["loss"]:
        assert all(0.1 < m["m2_masked_fraction"] < 0.9 for m in single_metrics)


@pytest.mark.heavy
@pytest.mark.parametrize("writer", ["fsdp", "one-process"])
def test_a_sharded_trainer_restores_a_checkpoint_exactly(tmp_path, writer):
    """A checkpoint (written whole by rank 0 of an fsdp trainer, or by one process) loads
    into a fresh 2-rank fsdp trainer: each rank's shards of the weights and of Adam's
    moments are the saved tensors' (rank 0's checked in place, both ranks' gathered back
    by a second save), and the next step equals one process's from the same checkpoint."""
    model_dir = save_tiny_model_dir(tmp_path / "model")
    data = batches()
    cfg = config(tmp_path, model_dir, "dapo", 2, "fsdp")
    single_cfg = config(tmp_path, model_dir, "dapo", 1)
    first = (
        parallel_trainer(cfg, model_dir, tmp_path / "writer")
        if writer == "fsdp"
        else single_trainer(single_cfg, model_dir)
    )
    try:
        train(first, data[:2])
        saved = first.save_checkpoint(tmp_path / "saved", TrainingState(2, 2, {}, {}))
    finally:
        first.close()

    restored = parallel_trainer(cfg, model_dir, tmp_path / "restored")
    try:
        assert restored.load_checkpoint(saved).step == restored.version == 2
        assert_rank0_shards_equal(restored.core, saved)
        again = restored.save_checkpoint(tmp_path / "again", TrainingState(2, 2, {}, {}))
        parallel_metrics = restored.step(data[2])
        weights = dict(restored.named_weights())
    finally:
        restored.close()
    assert_checkpoints_equal(saved, again)

    single = single_trainer(single_cfg, model_dir)
    single.load_checkpoint(saved)
    single_metrics = single.step(data[2])
    assert restored.version == single.version == 3
    saved_weights = load_file(saved / "model.safetensors")
    moved = 0.0
    for name, one in single.named_weights():
        # restored Adam moments keep the step's denominators away from zero: the float32
        # log-prob sums' rounding (~1e-16 here) is not amplified as in a first step
        torch.testing.assert_close(weights[name], one, atol=1e-9, rtol=0, msg=name)
        if name in saved_weights:  # a tied alias is saved once
            moved = max(moved, float((one - saved_weights[name]).abs().max()))
    assert moved > 1e-4  # the step from the checkpoint did change the weights
    assert parallel_metrics["loss"] == pytest.approx(single_metrics["loss"], abs=1e-8)
    assert parallel_metrics["grad_norm"] == pytest.approx(single_metrics["grad_norm"], rel=1e-6)


def assert_rank0_shards_equal(core, checkpoint: Path) -> None:
    """Rank 0 holds the first half (dim 0) of every saved weight and Adam moment, and the
    saved Adam step, exactly."""
    weights = load_file(checkpoint / "model.safetensors")
    tensors = load_file(checkpoint / "optimizer.safetensors")
    state = core.model.state_dict()
    for name, whole in weights.items():
        assert torch.equal(state[name].to_local(), whole.chunk(2)[0]), name
    params = [p for group in core.optimizer.param_groups for p in group["params"]]
    for index, param in enumerate(params):
        moments = core.optimizer.state[param]
        assert moments["exp_avg"].dtype == param.dtype == torch.float64
        for key in ("exp_avg", "exp_avg_sq"):
            local = moments[key].to_local()
            assert torch.equal(local, tensors[f"{index}.{key}"].chunk(2)[0]), (index, key)
        assert torch.equal(moments["step"], tensors[f"{index}.step"]), index
        assert float(moments["step"]) == 2


def assert_checkpoints_equal(a: Path, b: Path) -> None:
    """The same weights, Adam moments and steps (float64, bit for bit), hyper-parameters and
    schedule."""
    for file in ("model.safetensors", "optimizer.safetensors"):
        one, two = load_file(a / file), load_file(b / file)
        one = {k: v for k, v in one.items() if not k.startswith("rng.")}
        two = {k: v for k, v in two.items() if not k.startswith("rng.")}
        assert one.keys() == two.keys(), file
        for name in one:
            assert torch.equal(one[name], two[name]), (file, name)
    keys = {k.split(".", 1)[1] for k in load_file(a / "optimizer.safetensors")}
    assert keys == {"exp_avg", "exp_avg_sq", "step", "torch_rng"}
    state_a, state_b = (json.loads((c / "state.json").read_text()) for c in (a, b))
    assert state_a["optimizer"] == state_b["optimizer"]
    assert state_a["scheduler"] == state_b["scheduler"]


@pytest.mark.heavy
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
    ranks = [p for p in children if "asyncgrpo.learning.trainer.follower" in cmdline(p)]
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


@pytest.mark.heavy
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_torchrun_launch_trains_on_both_ranks(tmp_path, tiny_model_dir, strategy):
    """`torchrun --nproc_per_node 2 -m asyncgrpo.cli train RECIPE`: each rank reads
    RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (the agent's store); rank 0 runs the
    whole run and starts no rank of its own, rank 1 follows it. Every step waits for
    rank 1's reply (and its share of the all-reduce or all-gathers), so versions that
    advance mean both ranks trained."""
    recipe = write_recipe(
        tmp_path,
        tiny_model_dir,
        "torchrun",
        max_steps=4,
        checkpoint_steps=4,
        **{"trainer.collective_timeout_s": 60, "trainer.strategy": strategy},
    )
    run_dir, log = tmp_path / "torchrun", tmp_path / "torchrun.log"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [*launcher, "--nproc_per_node", "2", "--tee", "3"]
            + ["-m", "asyncgrpo.cli", "train", str(recipe)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    try:
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert [r["version"] for r in train_rows(run_dir)] == [1, 2, 3, 4]
    assert checkpoint_step(run_dir) == 4
    assert f"starting 2 trainer ranks ({strategy})" in text
    assert re.search(r"^\[\w*1\]:", text, re.M), "no output from rank 1"  # torchrun's prefix
    assert not (run_dir / "trainer-rank1.log").exists()  # torchrun's rank, not a spawned one


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.heavy
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_hung_rank_stops_the_job_within_the_collective_timeout(
    tmp_path, tiny_model_dir, strategy
):
    """A rank that is alive but stuck (SIGSTOP) is not noticed by polling its process:
    the collective timeout ends the wait. The job exits 1 within the timeout and a margin,
    names the stuck rank and the timeout, and leaves no process behind (rank 0 kills the
    stopped rank). The timeout also bounds rank 1's start-up (imports, model load): 15 s
    was too short for it beside a busy CI run on this 2-core machine."""
    timeout = 30
    recipe = write_recipe(
        tmp_path,
        tiny_model_dir,
        "dp-hang",
        max_steps=1000,
        **{
            "trainer.num_processes": 2,
            "trainer.collective_timeout_s": timeout,
            "trainer.strategy": strategy,
        },
    )
    run_dir, log = tmp_path / "dp-hang", tmp_path / "dp-hang.log"
    proc = start_cli(str(recipe), log=log)
    rank = None
    try:
        wait_for(lambda: checkpoint_step(run_dir) >= 2, 240, proc, log)
        assert [r["version"] for r in train_rows(run_dir)][:2] == [1, 2]
        children = descendants(proc.pid)
        ranks = [p for p in children if "asyncgrpo.learning.trainer.follower" in cmdline(p)]
        assert len(ranks) == 1, [cmdline(p) for p in children]
        rank = ranks[0]
        os.kill(rank, signal.SIGSTOP)
        stopped = time.monotonic()
        code = proc.wait(timeout=timeout + 60)
        elapsed = time.monotonic() - stopped
        text = log.read_text()
        assert code == 1, text[-3000:]
        # one timeout, plus a step's generation and the engine's shutdown
        assert elapsed < timeout + 30, (elapsed, text[-3000:])
        assert (
            "run aborted: trainer rank 1 did not finish its work within "
            f"trainer.collective_timeout_s ({timeout} s) and did not exit"
        ) in text, text[-3000:]
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{p}").exists() for p in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [cmdline(p) for p in children if Path(f"/proc/{p}").exists()]
        assert not left, f"a process was left behind: {left}"
    finally:
        proc.kill()
        if rank is not None and "asyncgrpo.learning.trainer.follower" in cmdline(rank):
            os.kill(rank, signal.SIGKILL)
            os.kill(rank, signal.SIGCONT)
