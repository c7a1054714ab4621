"""Reward functions that hang, crash or cannot be shipped to a worker: every call has a
deadline, a stuck call is named, a process worker is killed and replaced, and nothing
ever waits for a stuck call at shutdown (the process exits)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from asyncgrpo.learning.rollout.rewards import (
    RewardFunctionError,
    RewardRunner,
    RewardSpecError,
    RewardTimeout,
)

ROW = {"prompt": "q"}
TEXTS = ["a", "b"]
IDS = [[1], [2]]

# ---- functions a worker process can import (module level, by reference) ----------------


def sleep_forever(prompts, completions, **kw):
    time.sleep(3600)


def hang_or_answer(prompts, completions, pid_file, hang, **kw):
    """Writes its process id, then hangs when the row says so."""
    Path(pid_file[0]).write_text(str(os.getpid()))
    if hang[0]:
        time.sleep(3600)
    return [float(len(c)) for c in completions]


def segfault(prompts, completions, **kw):
    os.kill(os.getpid(), signal.SIGSEGV)


def raises_timeout_error(prompts, completions, **kw):
    raise TimeoutError("the verifier's own HTTP call timed out")


def score(runner: RewardRunner, row: dict = ROW) -> list:
    return asyncio.run(runner.score_group(row, TEXTS, IDS))


def process_gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


# ---- deadlines -------------------------------------------------------------------------


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_a_hanging_sync_function_times_out_and_is_named(workers):
    runner = RewardRunner([sleep_forever], timeout_s=0.5, workers=workers, num_workers=1)
    try:
        with pytest.raises(RewardTimeout, match=r"'sleep_forever' did not return within 0.5 s"):
            score(runner)
    finally:
        runner.close()
    assert RewardTimeout.reason == "reward_timeout"  # what the orchestrator counts it as


def test_a_hanging_async_function_is_cancelled_at_its_deadline():
    cancelled = []

    async def waits_forever(prompts, completions, **kw):
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def scenario():
        runner = RewardRunner([waits_forever], timeout_s=0.2)
        with pytest.raises(RewardTimeout, match=r"'waits_forever' did not return within 0.2 s"):
            await runner.score_group(ROW, TEXTS, IDS)
        await asyncio.sleep(0)  # the cancellation is delivered on the next turn of the loop
        assert runner.running.ages() == []

    asyncio.run(scenario())
    assert cancelled == [True]


def test_a_stuck_process_worker_is_killed_and_the_next_call_gets_a_fresh_one(tmp_path):
    pid_file = str(tmp_path / "pid")
    runner = RewardRunner([hang_or_answer], timeout_s=3, workers="process", num_workers=1)
    try:
        with pytest.raises(RewardTimeout, match="'hang_or_answer' did not return"):
            score(runner, {"prompt": "q", "pid_file": pid_file, "hang": True})
        stuck = int(Path(pid_file).read_text())
        assert stuck != os.getpid()
        assert process_gone(stuck), "the worker of the stuck call is still alive"
        assert runner.running.ages() == []

        assert score(runner, {"prompt": "q", "pid_file": pid_file, "hang": False}) == [[1.0, 1.0]]
        assert int(Path(pid_file).read_text()) != stuck
    finally:
        runner.close()


def test_a_worker_that_crashes_fails_only_its_own_call(tmp_path):
    pid_file = str(tmp_path / "pid")
    row = {"prompt": "q", "pid_file": pid_file, "hang": False}
    runner = RewardRunner([segfault], timeout_s=30, workers="process", num_workers=1)
    other = RewardRunner([hang_or_answer], timeout_s=30, workers="process", num_workers=1)
    try:
        with pytest.raises(RewardFunctionError, match=r"'segfault' crashed: .* signal SIGSEGV"):
            score(runner, row)
        assert score(other, row) == [[1.0, 1.0]]
    finally:
        runner.close()
        other.close()


def test_a_timeout_error_raised_by_the_function_is_an_error_not_a_missed_deadline():
    runner = RewardRunner([raises_timeout_error], timeout_s=30)
    with pytest.raises(
        RewardFunctionError, match=r"'raises_timeout_error' raised TimeoutError"
    ) as info:
        score(runner)
    assert not isinstance(info.value, RewardTimeout)


def test_stuck_threads_keep_their_slots_and_later_calls_say_what_holds_them():
    release = threading.Event()

    def blocked(prompts, completions, **kw):
        release.wait(60)
        return [0.0] * len(completions)

    runner = RewardRunner([blocked], timeout_s=0.3, num_workers=1)
    try:
        with pytest.raises(RewardTimeout, match="'blocked' did not return within 0.3 s"):
            score(runner)
        # the thread cannot be stopped: it still runs, and the watchdog sees it
        assert [name for name, _ in runner.running.ages()] == ["blocked"]
        with pytest.raises(
            RewardTimeout, match=r"no free reward thread within 0.3 s: all 1 are busy \('blocked'"
        ):
            score(runner)
    finally:
        release.set()
    deadline = time.monotonic() + 5
    while runner.running.ages() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert score(runner) == [[0.0, 0.0]]  # the slot came back when the thread returned


# ---- start-up checks -------------------------------------------------------------------


def test_process_workers_refuse_functions_they_could_not_import(monkeypatch):
    def local(prompts, completions, **kw):
        return [0.0] * len(completions)

    with pytest.raises(RewardSpecError, match=r"'local' cannot run in a worker process.*pickled"):
        RewardRunner([local], workers="process")
    with pytest.raises(RewardSpecError, match=r"'<lambda>' cannot run in a worker process"):
        RewardRunner([lambda prompts, completions, **kw: [0.0]], workers="process")

    local.__module__, local.__qualname__ = "__main__", "main_script_reward"
    monkeypatch.setattr(sys.modules["__main__"], "main_script_reward", local, raising=False)
    with pytest.raises(RewardSpecError, match="defined in the main script"):
        RewardRunner([local], workers="process")

    async def coroutine_reward(prompts, completions, **kw):  # runs on the loop: not shipped
        return [0.0] * len(completions)

    RewardRunner([coroutine_reward], workers="process").close()
    with pytest.raises(RewardSpecError, match="expected 'thread' or 'process'"):
        RewardRunner([sleep_forever], workers="fibers")


# ---- shutdown --------------------------------------------------------------------------

EXIT_SCRIPT = """
import asyncio, sys
sys.path.insert(0, {module_dir!r})
from asyncgrpo.learning.rollout.rewards import RewardRunner
import stuck_rewards

async def main():
    runner = RewardRunner([stuck_rewards.sleep_forever]{options})
    try:
        await asyncio.wait_for(runner.score_group({{"prompt": "q"}}, ["a"], [[1]]), 1.0)
    except (asyncio.TimeoutError, Exception) as exc:
        print("gave up:", type(exc).__name__, flush=True)
    runner.close()
    print("closed", flush=True)

if __name__ == "__main__":
    asyncio.run(main())
"""


@pytest.mark.parametrize("options", ["", ", workers='process'"], ids=["thread", "process"])
def test_the_process_exits_although_a_reward_call_never_returns(tmp_path, options):
    """The bug: the interpreter's exit waited for the stuck reward thread forever."""
    (tmp_path / "stuck_rewards.py").write_text(
        textwrap.dedent(
            """
            import time

            def sleep_forever(prompts, completions, **kw):
                time.sleep(3600)
            """
        )
    )
    script = tmp_path / "main.py"
    script.write_text(EXIT_SCRIPT.format(module_dir=str(tmp_path), options=options))
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the process did not exit with a reward call stuck:\n{out.decode()}")
    assert proc.returncode == 0, out.decode()
    assert b"closed" in out
