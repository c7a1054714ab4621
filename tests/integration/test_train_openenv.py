"""Training against an OpenEnv server through the whole pipeline, on a tiny random model.

The recipe names an app (`agent.openenv.app`), which the run serves with uvicorn in a
child process and stops at the end: tests/openenv_apps.py's `flaky_app`, the
guess-the-number example with the first episode's connection dropped at its `reset`.
Checked: that episode is an infra_error, counted and run again, and the run trains its
steps anyway; every trained sequence is a sample the gateway recorded, token for token,
its prompt holding the environment's first observation; the server is gone afterwards.

(The random model never writes a tool call, so each episode here is one reply; the
tool turns and their masks are checked in tests/unit/test_openenv.py, on a scripted
engine behind the same gateway.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_train import Recorder, base_config, flat, read_jsonl
from transformers import AutoTokenizer

from asyncgrpo import AsyncGRPOConfig
from asyncgrpo.learning.environments import openenv_server
from asyncgrpo.learning.rollout import episodes as episodes_mod
from asyncgrpo.run.loop import train
from asyncgrpo.testing import save_tiny_model_dir


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    """The tiny model with room for the tool description the gateway writes (~650 tokens of
    the tiny tokenizer)."""
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny-1k"), max_position_embeddings=1024)


@pytest.mark.heavy  # a whole training run (engine process, gateway, trainer): 10-20 s
def test_training_on_an_openenv_server(tmp_path, long_model_dir, monkeypatch):
    tiny_model_dir = long_model_dir
    monkeypatch.setenv("OPENENV_DROP_AT", "1")  # the first episode's reset never answers
    recorder = Recorder(monkeypatch)
    outcomes, served = [], []

    async def recording_run_episode(*args, **kwargs):
        outcome = await run_episode(*args, **kwargs)
        outcomes.append(outcome)
        return outcome

    run_episode = episodes_mod.run_episode
    monkeypatch.setattr(episodes_mod, "run_episode", recording_run_episode)
    start = openenv_server.ServedApp.__init__

    def serve(self, *args, **kwargs):
        start(self, *args, **kwargs)
        served.append(self)

    monkeypatch.setattr(openenv_server.ServedApp, "__init__", serve)
    cfg = base_config(
        tmp_path,
        tiny_model_dir,
        "openenv",
        max_steps=2,
        **{
            "engine.max_model_len": 1024,
            "trainer.micro_batch_tokens": 1024,
            "rollout.num_generations": 3,
            "agent.max_turns": 2,
            "agent.episode_timeout_s": 60,
            "agent.openenv": {"app": "tests.openenv_apps:flaky_app", "seeds": 20, "eval_seeds": 0},
        },
    )
    run_dir = train(AsyncGRPOConfig(**flat(cfg)))

    assert len(recorder.batches) == 2
    lines = read_jsonl(run_dir / "metrics.jsonl")
    train_lines = [x for x in lines if x["kind"] == "train"]
    assert [x["version"] for x in train_lines] == [1, 2]
    assert sum(x["episode_infra_retries"] for x in train_lines) >= 1
    assert sum(x["stop_reasons"].get("infra_error", 0) for x in train_lines) >= 1
    dropped = [o for o in outcomes if o.stop_reason.value == "infra_error"]
    assert dropped and "OpenEnv reset failed" in dropped[0].error
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    recorded = {tuple(s.input_ids): s for o in outcomes for s in o.samples}
    for groups in recorder.batches:
        for group in groups:
            assert isinstance(group.row.get("seed"), int)  # the rows the adapter made
            for r in group.rollouts:
                sample = recorded[tuple(r.prompt_ids + r.completion_ids)]  # token for token
                assert [0] * len(r.prompt_ids) + r.completion_mask == sample.loss_mask
                assert "I picked a whole number" in tokenizer.decode(r.prompt_ids)
    [server] = served
    assert server.process.poll() is not None  # stopped with the run
    accounting = json.loads((run_dir / "accounting.json").read_text())
    assert accounting["consumed"] == 4, accounting


@pytest.mark.slow
def test_smollm2_learns_guess_the_number_from_the_openenv_example(tmp_path, monkeypatch):
    """recipes/openenv_guess.yaml on SmolLM2-135M, cut to a few steps: the held-out reward
    (16 seeds x 2 sampled episodes) after training beats the one before."""
    root = Path(__file__).parents[2]
    monkeypatch.chdir(root)  # the recipe's app, dataset and grader are paths from the root
    cfg = yaml.safe_load((root / "recipes" / "openenv_guess.yaml").read_text())
    cfg.update(output_dir=str(tmp_path), max_steps=6, eval_steps=3, max_time_s=1800)
    run_dir = train(AsyncGRPOConfig(**flat(cfg)))
    evals = [x for x in read_jsonl(run_dir / "metrics.jsonl") if x["kind"] == "eval"]
    rewards = [x["eval_reward_mean"] for x in evals]
    print("held-out reward by evaluation:", rewards)
    print("finished the game:", [x.get("eval_env_done") for x in evals])
    assert len(rewards) >= 2 and rewards[-1] > rewards[0], rewards
