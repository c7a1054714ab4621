"""A run in which no group can succeed stops, quickly and clearly, instead of spinning.

On the tiny model, through the CLI (exit code) and the API (exception):

- a reward function that raises on every call ends the run within 60 s, non-zero,
  naming the function and its first error;
- rewards that are the same for every completion end it saying so, with a sample;
- a run whose batches never come (a reward that never returns) ends near
  `max_time_s`, not at `rollout.request_timeout_s`, non-zero (a run that trained and
  then ran out of time ends normally);
- rows without a prompt: a data file is refused before the engine starts, and rows
  that reach the pipeline anyway (the real loop with a fake engine) stop the run
  after a bounded number of drops, never in a hot loop.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml
from test_train import base_config, flat

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.base.config import AdvantageConfig
from asyncgrpo.learning.rollout.rewards import RewardRunner
from asyncgrpo.learning.rollout.single_turn import SamplingSettings, SingleTurnBuilder
from asyncgrpo.run.loop import run_to_end
from asyncgrpo.run.session import RunAborted
from asyncgrpo.testing import even_token_reward, tiny_prompt_rows

REWARDS = """
import time

def always_raises(prompts, completions, **kwargs):
    raise ValueError("the judge is not configured")

def never_returns(prompts, completions, **kwargs):
    time.sleep(3600)
"""


def run_cli(tmp_path: Path, cfg: dict, timeout_s: float) -> tuple[int, str, float]:
    """`asyncgrpo train` on `cfg` with `spin_rewards` importable: (exit code, output, seconds)."""
    (tmp_path / "spin_rewards.py").write_text(textwrap.dedent(REWARDS))
    recipe = tmp_path / f"{cfg['name']}.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncgrpo.cli", "train", str(recipe)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the run did not end within {timeout_s:g} s:\n{out.decode()[-3000:]}")
    return proc.returncode, out.decode(), time.monotonic() - start


def recipe(tmp_path: Path, model_dir: Path, name: str, reward: str, **overrides) -> dict:
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in tiny_prompt_rows(40)) + "\n")
    cfg = base_config(tmp_path, model_dir, name, **overrides)
    cfg["dataset"] = {"path": str(data)}
    cfg["rewards"] = [reward]
    return cfg


@pytest.mark.heavy
def test_a_reward_that_always_raises_ends_the_run_naming_it(tmp_path, tiny_model_dir):
    cfg = recipe(tmp_path, tiny_model_dir, "raises", "spin_rewards:always_raises")
    code, out, elapsed = run_cli(tmp_path, cfg, timeout_s=120)
    assert code == 1, out[-3000:]
    assert elapsed < 60, f"took {elapsed:.0f} s"
    assert "run aborted: no progress: the last" in out, out[-3000:]
    assert (
        "First reward_error: reward function 'always_raises' raised ValueError: "
        "the judge is not configured" in out
    ), out[-3000:]
    assert "fix: correct the reward function named above" in out
    failures = json.loads((tmp_path / "raises" / "accounting.json").read_text())["failures"]
    assert 12 <= failures["reward_error"] < 200, failures  # stopped, and never hot


@pytest.mark.slow
def test_a_reward_that_always_raises_ends_the_demo_recipe_within_60_s(tmp_path):
    """The acceptance case on the shipped model: `recipes/demo.yaml` with its reward
    replaced by one that always raises (engine start and model loading included)."""
    demo = Path(__file__).parents[2] / "recipes" / "demo.yaml"
    cfg = yaml.safe_load(demo.read_text())
    cfg.update(name="demo-raises", output_dir=str(tmp_path), rewards=["spin_rewards:always_raises"])
    code, out, elapsed = run_cli(tmp_path, cfg, timeout_s=180)
    print(f"demo recipe, always-raising reward: exit {code} after {elapsed:.1f} s")
    assert code == 1, out[-3000:]
    assert elapsed < 60, f"took {elapsed:.0f} s"
    assert "run aborted: no progress: the last" in out, out[-3000:]
    assert "reward function 'always_raises' raised ValueError" in out, out[-3000:]


@pytest.mark.heavy
def test_constant_rewards_end_the_run_with_a_sample(tmp_path, tiny_model_dir):
    def constant_reward(prompts, completions, **kwargs):
        return [0.5] * len(completions)

    overrides = {"rollout.filter_zero_variance": True}
    args = AsyncGRPOConfig(**flat(base_config(tmp_path, tiny_model_dir, "constant", **overrides)))
    trainer = AsyncGRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=[constant_reward],
        train_dataset=tiny_prompt_rows(40),
        args=args,
    )
    start = time.monotonic()
    with pytest.raises(RunAborted) as aborted:
        trainer.train()
    assert time.monotonic() - start < 150
    message = str(aborted.value)
    assert message.startswith("no progress: the last"), message
    assert "(zero_variance: " in message
    assert "The rewards are constant" in message
    assert "prompt: [{'role': 'user', 'content': 'What is" in message
    assert "completion: " in message and "-> rewards [0.5]" in message
    assert "rollout.filter_zero_variance: false" in message


@pytest.mark.heavy
def test_max_time_s_ends_a_run_whose_batches_never_come(tmp_path, tiny_model_dir):
    cfg = recipe(
        tmp_path,
        tiny_model_dir,
        "slow",
        "spin_rewards:never_returns",
        max_time_s=20,
        **{"rollout.reward_timeout_s": 500, "rollout.request_timeout_s": 500},
    )
    code, out, elapsed = run_cli(tmp_path, cfg, timeout_s=180)
    assert code == 1, out[-3000:]  # no step was taken: a failure, not an end
    assert "run aborted: no batch came within max_time_s (20 s), so no optimizer step" in out
    assert "a reward function or the engine slower than the budget" in out
    assert "reward calls: 'never_returns'" in out, out[-3000:]  # what it waited for
    assert elapsed < 20 + 60, f"took {elapsed:.0f} s"


class HangsAfter:
    """A fake `GroupBuilder` whose groups after the first `groups` never come."""

    def __init__(self, groups: int):
        self.groups = groups

    def __call__(self, engine):
        builder = unit_fakes().FakeBuilder(engine)
        build, left = builder.build, [self.groups]

        async def build_then_hang(group_id, row):
            left[0] -= 1
            if left[0] < 0:
                await asyncio.Event().wait()
            return await build(group_id, row)

        builder.build = build_then_hang
        return builder


@pytest.mark.parametrize("steps", [0, 1])
def test_max_time_s_before_the_first_step_is_an_error_after_it_an_end(tmp_path, steps):
    """Through the API (`run_to_end`, what `train()` runs): no step in the budget raises,
    a step then the budget spent returns as a normal end."""
    fakes = unit_fakes()
    cfg = fakes.run_config(tmp_path)
    cfg.max_time_s, cfg.rollout.request_timeout_s = 3.0, 300
    groups = steps * cfg.coordinator.batch_groups
    r = fakes.assemble(cfg, [{"prompt": f"p{i}"} for i in range(5)], builder=HangsAfter(groups))
    start = time.monotonic()
    if steps == 0:
        with pytest.raises(RunAborted, match=r"^no batch came within max_time_s \(3 s\)"):
            run_to_end(r, threading.Event())
    else:
        run_to_end(r, threading.Event())
    assert r.step == steps
    assert time.monotonic() - start < 30


def test_a_data_file_row_without_a_prompt_is_refused_up_front(tmp_path, tiny_model_dir):
    cfg = recipe(tmp_path, tiny_model_dir, "noprompt", "asyncgrpo.testing:even_token_reward")
    rows = [{"question": r["prompt"][0]["content"]} for r in tiny_prompt_rows(10)]
    Path(cfg["dataset"]["path"]).write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    code, out, elapsed = run_cli(tmp_path, cfg, timeout_s=120)
    assert code != 0, out[-3000:]
    assert "has no 'prompt' column" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert elapsed < 60


def unit_fakes():
    """The fake engine, trainer and run assembly of `tests/unit/test_roles.py`."""
    path = Path(__file__).parents[1] / "unit" / "test_roles.py"
    spec = importlib.util.spec_from_file_location("role_fakes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.heavy
def test_rows_without_a_prompt_in_the_pipeline_stop_it_without_a_hot_loop(tmp_path):
    """Rows that skipped the up-front checks: the real single-turn builder, orchestrator,
    producer and batch wait, with a fake engine (the builder refuses before generating)."""
    fakes = unit_fakes()
    rewards = RewardRunner([even_token_reward])

    def builder(engine):
        sampling = SamplingSettings(n=2, max_tokens=4, temperature=1.0)
        return SingleTurnBuilder(None, None, rewards, sampling, AdvantageConfig())

    cfg = fakes.run_config(tmp_path)
    cfg.rollout.request_timeout_s = 300
    rows = [{"question": f"q{i}"} for i in range(5)]
    r = fakes.assemble(cfg, rows, builder=builder, rewards=rewards)
    start = time.monotonic()
    with pytest.raises(RunAborted) as aborted:
        run_to_end(r, threading.Event())
    assert time.monotonic() - start < 60
    message = str(aborted.value)
    assert "(missing_prompt: " in message, message
    assert "a dataset row has no 'prompt' column (its columns: question)" in message
    assert "fix: give every dataset row a 'prompt' column" in message
    drops = r.orchestrator.failures["missing_prompt"]
    assert 12 <= drops < 100, f"{drops} drops: the producer looped hot"
