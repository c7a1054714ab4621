"""`asyncgrpo train` for `SOAK_MINUTES` while its processes are killed, several times each.

One run of the tiny model on the builtin arithmetic task, with two ddp trainer ranks
(gloo), its embedded engine and reward functions in worker processes. At random times,
each only once the run has trained a step since the previous fault: the engine process
is killed (SIGKILL; the run restarts it and goes on), a reward worker is killed (its
group is dropped as a reward error, the next call gets a fresh worker), and trainer rank
1 is killed (the run stops, exit 1, and is resumed with `--resume`, as an operator or a
job scheduler would). The run's `max_time_s` is the soak's length, a budget of training
time that counts every session's, so the run ends on its own, exit 0.

At the end: the optimizer steps are 1..N, each once; every prompt position handed out is
counted once, trained or dropped (`cursor - pending == consumed + dropped` in the last
checkpoint), dropped only as a killed reward worker's or as too stale; `samples.jsonl`
holds each trained position once, `consumed` of them, each with the prompt the stream
gives that position; `accounting.json` is the last checkpoint's; and no process of any
session outlives it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from soak_support import (
    alive,
    command_line,
    fault_times,
    in_process_group,
    process_tree,
    read_jsonl,
    soak_seconds,
    write_summary,
)

from asyncgrpo.learning.rollout.data import load_prompts
from asyncgrpo.learning.rollout.prompts import PromptStream

pytestmark = pytest.mark.soak

SEED = 3
DATASET = {"builtin": "arithmetic", "size": 64, "eval_size": 4}
ROLES = {  # a process's role, by what its command line runs
    "engine": "asyncgrpo.cli serve",
    "rank": "asyncgrpo.learning.trainer.follower",
    "reward": "asyncgrpo.learning.rollout.reward_workers",
}
# a killed reward worker's group, and a group past max_staleness when a kill held the
# trainer back (a stale prompt is not retried): both counted; nothing else is lost
ALLOWED_DROPS = {"reward_error", "stale"}


def write_recipe(tmp_path: Path, model_dir: Path, seconds: float) -> Path:
    cfg = {
        "name": "soak",
        "output_dir": str(tmp_path),
        "seed": SEED,
        "max_steps": 1_000_000,
        "max_time_s": seconds,  # the end: training time, every session's counted
        "eval_steps": 1_000_000,
        "checkpoint_steps": 5,
        "best_checkpoint_metric": None,
        "model": {"name_or_path": str(model_dir)},
        "dataset": DATASET,
        "rewards": ["asyncgrpo.testing:even_token_reward"],
        "engine": {"dtype": "float32", "num_threads": 1, "max_num_seqs": 16, "max_model_len": 192},
        "rollout": {
            "num_generations": 4,
            "max_tokens": 8,
            "filter_zero_variance": False,
            "reward_workers": "process",
            "reward_num_workers": 2,
            "reward_timeout_s": 60,
        },
        "coordinator": {"batch_groups": 2, "max_staleness": 1},
        "trainer": {
            "num_processes": 2,
            "strategy": "ddp",
            "collective_timeout_s": 120,
            "learning_rate": 1e-3,
            "micro_batch_tokens": 128,
            "bf16_autocast": False,
        },
    }
    recipe = tmp_path / "soak.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    return recipe


class Sessions:
    """The run's sessions, one process at a time, and every process they started."""

    def __init__(self, recipe: Path, run_dir: Path):
        self.recipe, self.run_dir = recipe, run_dir
        self.log = run_dir.parent / "train.log"
        self.process: subprocess.Popen | None = None
        self.exits: list[int] = []
        self.seen: dict[int, str] = {}  # every descendant seen: pid -> command line
        self.groups: list[int] = []  # each session's process group
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="process-tree", daemon=True).start()

    def start(self) -> None:
        args = ["--resume", str(self.run_dir)] if self.exits else [str(self.recipe)]
        command = [sys.executable, "-m", "asyncgrpo.cli", "train", *args]
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.groups.append(self.process.pid)

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            process = self.process
            if process is not None and process.poll() is None:
                for pid in process_tree(process.pid):
                    self.seen.setdefault(pid, command_line(pid))

    def role_pids(self, role: str) -> list[int]:
        if self.process is None or self.process.poll() is not None:
            return []
        tree = process_tree(self.process.pid)
        return [pid for pid in tree if ROLES[role] in command_line(pid) and alive(pid)]

    def stop(self) -> None:
        self._stop.set()
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def left_behind(self, within_s: float = 20) -> list[str]:
        """Processes of any session still alive `within_s` after it ended."""
        deadline = time.monotonic() + within_s
        while True:
            # a pid is the same process while its command line is (pids are reused)
            left = [p for p, c in self.seen.items() if c and alive(p) and command_line(p) == c]
            left += [pid for group in self.groups for pid in in_process_group(group)]
            if not left or time.monotonic() > deadline:
                return [f"{pid}: {self.seen.get(pid) or command_line(pid)}" for pid in set(left)]
            time.sleep(0.5)


def last_step(run_dir: Path) -> int:
    """The newest optimizer step in `metrics.jsonl` (read from its end: it grows long)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    with path.open("rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
        lines = f.read().decode(errors="replace").splitlines()
    for line in reversed(lines):
        if '"kind":"train"' in line.replace(" ", ""):
            try:
                return json.loads(line)["step"]
            except ValueError:
                continue  # the first line read, cut in its middle
    return 0


def schedule(rng: random.Random, seconds: float, count: int) -> list[tuple[float, str]]:
    faults = []
    for role in ROLES:
        faults += [(t, role) for t in fault_times(rng, count, 0.08 * seconds, 0.65 * seconds)]
    return sorted(faults)


def run_with_faults(sessions: Sessions, faults: list, started: float, seconds: float) -> list:
    """Kill on time (each fault waiting for a step trained since the previous one), resume
    after a rank's kill, until the run ends: the faults injected as (seconds, role)."""
    injected, pending, trained_at, rank_killed = [], list(faults), 0, False
    sessions.start()
    while True:
        code = sessions.process.poll()
        if code is not None:
            sessions.exits.append(code)
            if not (rank_killed and code == 1):
                return injected
            sessions.start()  # the operator's --resume
            rank_killed = False
        if time.time() - started > 2 * seconds + 600:
            raise AssertionError(f"the run has not ended after {time.time() - started:.0f} s")
        elapsed = time.time() - started
        due = pending and pending[0][0] <= elapsed < 0.9 * seconds
        if due and last_step(sessions.run_dir) > trained_at:
            pids = sessions.role_pids(pending[0][1])
            if pids:
                os.kill(random.choice(pids), signal.SIGKILL)
                injected.append((round(time.time() - started, 1), pending.pop(0)[1]))
                trained_at = last_step(sessions.run_dir)
                rank_killed = rank_killed or injected[-1][1] == "rank"
        time.sleep(0.5)


def test_train_soak(tiny_model_dir, tmp_path):
    seconds = soak_seconds()
    rng = random.Random(int(os.environ.get("SOAK_SEED", "0")))
    count = max(1, round(seconds / 180))  # 5 of each in 15 minutes
    run_dir = tmp_path / "soak"
    sessions = Sessions(write_recipe(tmp_path, tiny_model_dir, seconds), run_dir)
    started = time.time()
    try:
        injected = run_with_faults(sessions, schedule(rng, seconds, count), started, seconds)
    finally:
        sessions.stop()
    left = sessions.left_behind()
    figures = run_figures(run_dir)
    summary = {
        "minutes": seconds / 60,
        "wall_minutes": round((time.time() - started) / 60, 2),
        "faults_scheduled_per_role": count,
        "faults_injected": dict(Counter(role for _, role in injected)),
        "fault_times_s": injected,
        "session_exits": sessions.exits,
        "processes_seen": len(sessions.seen),
        "processes_seen_by_role": {
            role: sum(1 for c in sessions.seen.values() if pattern in c)
            for role, pattern in ROLES.items()
        },
        "left_behind": left,
        **figures,
    }
    write_summary(tmp_path, "train_soak", summary)
    assert sessions.exits[-1] == 0, sessions.log.read_text()[-3000:]
    assert sessions.exits.count(1) == summary["faults_injected"].get("rank", 0)
    assert summary["faults_injected"] == {role: count for role in ROLES}, injected
    assert not left, left
    assert_every_prompt_trained_once(figures)


def run_figures(run_dir: Path) -> dict:
    """The run's record at its end: steps, the last checkpoint's position and accounting,
    `accounting.json`, and what `samples.jsonl` holds."""
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    state = json.loads((run_dir / "checkpoints" / latest / "state.json").read_text())
    samples = read_jsonl(run_dir / "samples.jsonl")
    rows, _ = load_prompts(DATASET, SEED)
    stream = PromptStream(rows, SEED)  # the run's order of prompts, position by position
    served = [stream.next()[1]["prompt"] for _ in range(state["data_position"]["cursor"])]
    wrong_prompt = [
        s["group_id"]
        for s in samples
        if s["group_id"] >= len(served) or served[s["group_id"]] != s["prompt"]
    ]
    accounting = state["extra"]["accounting"]
    return {
        "steps": [r["step"] for r in train],
        "versions": [r["version"] for r in train],
        "checkpoint_step": state["step"],
        "position": state["data_position"],
        "accounting": accounting,
        "accounting_file": json.loads((run_dir / "accounting.json").read_text()),
        "samples": len(samples),
        "sample_positions": [s["group_id"] for s in samples],
        "samples_with_wrong_prompt": wrong_prompt,
        "engine_restarts": accounting.get("engine_restarts"),
    }


def assert_every_prompt_trained_once(figures: dict) -> None:
    steps, accounting, position = figures["steps"], figures["accounting"], figures["position"]
    assert steps == list(range(1, len(steps) + 1)), "a step is missing or repeated"
    assert figures["versions"] == steps
    assert figures["checkpoint_step"] == steps[-1], "the run did not end on a checkpoint"
    # accounting.json, written at the end: the last checkpoint's counts, and what was
    # queued or in flight then
    final = figures["accounting_file"]
    for key in ("consumed", "dropped", "engine_restarts"):
        assert final.get(key) == accounting.get(key), key
    in_buffer = final["queued"] + final["in_flight"]
    assert final["admitted"] == final["consumed"] + sum(final["dropped"].values()) + in_buffer
    positions = figures["sample_positions"]
    assert len(positions) == len(set(positions)), "a prompt was trained twice"
    assert len(positions) == accounting["consumed"] == 2 * steps[-1]
    ended = position["cursor"] - len(position["pending"])
    assert ended == accounting["consumed"] + sum(accounting["dropped"].values())
    assert not set(positions) & set(position["pending"]), "a trained prompt is pending again"
    assert max(positions) < position["cursor"]
    assert set(accounting["dropped"]) <= ALLOWED_DROPS, accounting["dropped"]
    assert not figures["samples_with_wrong_prompt"]
