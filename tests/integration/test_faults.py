"""Faults that used to hang a run, on a real engine process and a tiny model.

- A reward function that never returns: the run ends with a message naming it within
  `rollout.reward_timeout_s`, and the trainer process exits (it used to wait for the
  stuck thread forever), with thread and with process workers.
- An engine that stalls (SIGSTOP) when weights are synced: the sync misses
  `engine.sync_timeout_s`, says so while it waits, and the embedded engine is killed,
  restarted and the run finishes; an external engine ends the run with a clear error.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.base.config import ExternalEngineConfig
from asyncgrpo.inference.backend import EngineDied
from asyncgrpo.inference.backend.external import ExternalBackend
from asyncgrpo.learning.trainer import policy_trainer as trainer_loop
from asyncgrpo.testing import engine_children, even_token_reward, tiny_prompt_rows

ENGINE_SETTINGS = {"max_model_len": 128}


def run_settings(tmp_path: Path, model_dir: Path, name: str) -> dict:
    return {
        "name": name,
        "output_dir": str(tmp_path),
        "seed": 3,
        "max_steps": 5,
        "eval_steps": 100,
        "checkpoint_steps": 2,
        "model": {"name_or_path": str(model_dir)},
        "engine": {"dtype": "float32", "num_threads": 1, "max_num_seqs": 16, "max_model_len": 128},
        "rollout": {"num_generations": 4, "max_tokens": 8, "filter_zero_variance": False},
        "coordinator": {"batch_groups": 2, "max_staleness": 1},
        "trainer": {"learning_rate": 1e-3, "micro_batch_tokens": 96, "bf16_autocast": False},
    }


def pids_gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while any(Path(f"/proc/{p}").exists() for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


# ---- a reward function that never returns ---------------------------------------------

STUCK_REWARDS = """
import os, time
from pathlib import Path

def sleep_forever(prompts, completions, **kw):
    Path(os.environ["STUCK_PID_FILE"]).write_text(str(os.getpid()))
    time.sleep(3600)
"""


@pytest.mark.heavy
@pytest.mark.parametrize("workers", ["thread", "process"])
def test_a_reward_that_never_returns_ends_the_run_and_the_process_exits(
    tmp_path, tiny_model_dir, workers
):
    (tmp_path / "stuck_rewards.py").write_text(textwrap.dedent(STUCK_REWARDS))
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in tiny_prompt_rows(20)) + "\n")
    cfg = run_settings(tmp_path, tiny_model_dir, "stuck")
    cfg["dataset"] = {"path": str(data)}
    cfg["rewards"] = ["stuck_rewards:sleep_forever"]
    cfg["rollout"].update(
        reward_timeout_s=3,
        reward_error_policy="abort",
        reward_workers=workers,
        request_timeout_s=30,  # before the fix: "no batch", then a process that never exits
    )
    recipe = tmp_path / "stuck.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    pid_file = tmp_path / "reward.pid"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        STUCK_PID_FILE=str(pid_file),
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncgrpo.cli", "train", str(recipe)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the trainer did not exit:\n{out.decode()[-3000:]}")
    text = out.decode()
    assert proc.returncode == 1, text[-3000:]
    assert (
        "run aborted: reward function 'sleep_forever' did not return within 3 s "
        "(rollout.reward_timeout_s)" in text
    ), text[-3000:]
    reward_pid = int(pid_file.read_text())
    assert (reward_pid == proc.pid) == (workers == "thread")
    assert pids_gone([reward_pid], within_s=10), "the stuck reward worker outlived the run"
    accounting = json.loads((tmp_path / "stuck" / "accounting.json").read_text())
    assert accounting["failures"].get("reward_timeout", 0) >= 1


# ---- an engine that stalls during a weight sync ----------------------------------------


def test_an_external_engine_that_stalls_in_a_sync_ends_it_with_a_clear_error(
    server, monkeypatch, caplog
):
    monkeypatch.setenv("ASYNCGRPO_ADMIN_TOKEN", server.admin_token)
    cfg = ExternalEngineConfig(base_url=server.base_url, sync_timeout_s=2)
    backend = ExternalBackend(cfg)
    weights = [("model.norm.weight", torch.ones(64))]

    async def sync_while_stopped() -> None:
        await backend.client.wait_until_healthy(30)
        os.kill(server.pid, signal.SIGSTOP)
        try:
            await backend.sync_weights(weights, version=1, mode="keep")
        finally:
            os.kill(server.pid, signal.SIGCONT)
            await backend.close()

    with caplog.at_level(logging.WARNING, logger="asyncgrpo.inference.backend"):
        with pytest.raises(EngineDied) as died:
            asyncio.run(sync_while_stopped())
    message = str(died.value)
    assert "did not finish within 2 s (engine.sync_timeout_s); it was pausing the engine" in message
    assert f"the engine at {server.base_url} is stalled" in message
    assert "weight sync to the engine has taken" in caplog.text  # said while it waited


@pytest.mark.heavy
def test_an_engine_stopped_before_a_weight_sync_is_restarted_and_the_run_finishes(
    tmp_path, tiny_model_dir, monkeypatch, caplog
):
    stopped: list[int] = []
    batches: list[list] = []
    original = trainer_loop.PolicyTrainer.step
    others = set(engine_children())  # e.g. this module's `server`

    def step(trainer, groups):  # SIGSTOP the engine in step 2; the sync after it stalls
        batches.append(copy.deepcopy(groups))
        if len(batches) == 2:
            stopped.extend(set(engine_children()) - others)
            for pid in stopped:
                os.kill(pid, signal.SIGSTOP)
        return original(trainer, groups)

    monkeypatch.setattr(trainer_loop.PolicyTrainer, "step", step)
    settings = run_settings(tmp_path, tiny_model_dir, "stalled")
    flat = {f"{k}.{f}": v for k, d in settings.items() if isinstance(d, dict) for f, v in d.items()}
    flat.update({k: v for k, v in settings.items() if not isinstance(v, dict)})
    flat["engine.sync_timeout_s"] = 5
    trainer = AsyncGRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=[even_token_reward],
        train_dataset=tiny_prompt_rows(40),
        args=AsyncGRPOConfig(**flat),
    )
    try:
        with caplog.at_level(logging.WARNING, logger="asyncgrpo.inference.backend"):
            run_dir = trainer.train()
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert stopped, "no engine child was found to stop"
    assert pids_gone(stopped, within_s=5), "the stopped engine was not killed"
    assert "weight sync to the engine has taken" in caplog.text
    assert "did not finish within 5 s (engine.sync_timeout_s)" in caplog.text
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m.get("kind") == "train"] == [1, 2, 3, 4, 5]
    accounting = json.loads((run_dir / "accounting.json").read_text())
    assert accounting["engine_restarts"] == 1
    # the restarted engine got the weights of step 2 again: later samples carry newer versions
    assert max(v for g in batches[-1] for r in g.rollouts for v in r.versions) >= 2
    assert set(engine_children()) == others
