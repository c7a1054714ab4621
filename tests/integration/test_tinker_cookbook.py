"""tinker-cookbook's `rl.train`, unmodified, trains against `asyncgrpo tinker-serve`.

The cookbook (0.5.8, what pip resolves here) runs in its own environment (`make
cookbook-venv`; `ASYNCGRPO_COOKBOOK_PYTHON` names another), as a child process running
`tinker_cookbook_env.py`: an addition task, the `role_colon` renderer, the tokenizer from
the served model's directory. The server runs in this process on the tiny model in fp32,
as in `test_tinker_api.py`. Skipped where that environment or its cookbook is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from tinker_server import API_KEY, serve_tinker

pytest.importorskip("peft")
pytest.importorskip("tinker")


pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
REPO = HERE.parent.parent


@pytest.fixture(scope="module")
def cookbook_python() -> str:
    """The cookbook environment's Python; skips the module where it cannot import it."""
    python = os.environ.get("ASYNCGRPO_COOKBOOK_PYTHON", str(REPO / ".venv-cookbook/bin/python"))
    if not Path(python).is_file():
        pytest.skip(f"no tinker-cookbook environment at {python} (`make cookbook-venv`)")
    probe = subprocess.run([python, "-c", "import tinker_cookbook"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"{python} cannot import tinker_cookbook: {probe.stderr.decode()[-300:]}")
    return python


@pytest.fixture(scope="module")
def served(cookbook_python, tiny_model_dir, tmp_path_factory):
    """(base url, state dir) of tinker-serve on the tiny model, fp32, uvicorn on a thread."""
    state = tmp_path_factory.mktemp("cookbook-state")
    with serve_tinker(tiny_model_dir, state) as url:
        yield url, state


def run_cookbook(python: str, url: str, model_dir: Path, log_path: Path, *flags: str) -> list[dict]:
    """`rl.train` on the addition task; its metrics, one dict per trained step."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(TINKER_API_KEY=API_KEY, TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1")
    command = [python, str(HERE / "tinker_cookbook_env.py"), "--base-url", url]
    command += ["--model", str(model_dir), "--log-path", str(log_path), *flags]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = (log_path / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def saved_final_state(log_path: Path, state_dir: Path) -> Path:
    """The directory of the `final` state the cookbook recorded in checkpoints.jsonl."""
    records = [json.loads(x) for x in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    path = records[-1]["state_path"]
    model_id, kind, name = path.removeprefix("tinker://").split("/")
    assert (kind, name) == ("weights", "final")
    return state_dir / model_id.replace(":", "_") / kind / name


def test_rl_train_runs_two_sync_steps_and_saves_its_final_state(
    cookbook_python, served, tiny_model_dir, tmp_path
):
    url, state_dir = served
    metrics = run_cookbook(cookbook_python, url, tiny_model_dir, tmp_path / "log", "--steps", "2")
    assert [m["progress/batch"] for m in metrics] == [0, 1]
    for step in metrics:
        assert step["env/all/total_episodes"] == 8  # 2 groups of 4 each step
        # the sampler's log-probs are the trainer's (fp32): KL(sampler || learner) ~ 0
        assert abs(step["optim/kl_sample_train_v1"]) < 1e-3
    final = saved_final_state(tmp_path / "log", state_dir)
    assert (final / "tensors.safetensors").is_file() and (final / "state.json").is_file()


def test_rl_train_async_mode_trains_on_samples_at_most_one_step_old(
    cookbook_python, served, tiny_model_dir, tmp_path
):
    url, _ = served
    flags = ("--steps", "3", "--async-off-policy", "1")
    metrics = run_cookbook(cookbook_python, url, tiny_model_dir, tmp_path / "log", *flags)
    # the last batch may come too late (more than one step stale) and be dropped
    assert [m["training_client/step"] for m in metrics] == list(range(len(metrics))) != []
    for step in metrics:
        assert step["env/all/total_episodes"] == 8
        lag = step["training_client/step"] - step["sampling_client/step_min"]
        assert 0 <= lag <= 1
        assert step["sampling_client/step_max"] <= step["training_client/step"]
