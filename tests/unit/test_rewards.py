"""RewardRunner: TRL's calling convention, sync and async functions, and clear failures."""

import asyncio
import threading

import numpy as np
import pytest

from asyncgrpo.learning.rollout.rewards import (
    RewardFailure,
    RewardFunctionError,
    RewardRunner,
    RewardSpecError,
)
from asyncgrpo.learning.tasks.arithmetic import arithmetic_reward

CHAT_ROW = {"prompt": [{"role": "user", "content": "What is 3 + 4?"}], "answer": "7", "level": 2}
TEXTS = ["7", "3 + 4 = 7", "8"]
IDS = [[5], [1, 2, 3], [6]]


def score(runner, row=CHAT_ROW, texts=TEXTS, ids=IDS):
    return asyncio.run(runner.score_group(row, texts, ids))


def test_trl_arguments_for_a_conversational_prompt():
    seen = {}

    def spy(prompts, completions, completion_ids, **columns):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, **columns)
        return [1.0, 0.0, None]

    runner = RewardRunner([spy])
    assert score(runner) == [[1.0, 0.0, None]]
    assert seen["prompts"] == [CHAT_ROW["prompt"]] * 3
    assert seen["completions"] == [[{"role": "assistant", "content": t}] for t in TEXTS]
    assert seen["ids"] == IDS
    assert seen["answer"] == ["7"] * 3 and seen["level"] == [2] * 3
    assert runner.names == ["spy"]
    runner.close()


def test_plain_prompt_gets_plain_completions_and_builtin_names_resolve():
    runner = RewardRunner(["arithmetic_reward", "number_only_reward"])
    row = {"prompt": "What is 3 + 4?", "answer": "7"}
    assert score(runner, row) == [[1.0, 0.5, 0.0], [1.0, 0.0, 1.0]]
    assert runner.names == ["arithmetic_reward", "number_only_reward"]
    assert RewardRunner([arithmetic_reward]).funcs == [arithmetic_reward]


def test_sync_functions_run_off_the_event_loop_and_async_ones_are_awaited():
    threads = []

    def sync_fn(prompts, completions, **kw):
        threads.append(threading.current_thread().name)
        return [0.5] * len(completions)

    async def async_fn(prompts, completions, **kw):
        await asyncio.sleep(0)
        threads.append(threading.current_thread().name)
        return np.array([1.0, float("nan"), 2.0])  # arrays are fine; NaN means no score

    runner = RewardRunner([sync_fn, async_fn])
    assert score(runner) == [[0.5, 0.5, 0.5], [1.0, None, 2.0]]
    assert threads[0].startswith("reward") and threads[1] == threading.main_thread().name
    runner.close()


def test_a_slow_sync_function_does_not_block_the_loop():
    release = threading.Event()

    def slow(prompts, completions, **kw):
        release.wait(5)
        return [0.0] * len(completions)

    async def main():
        runner = RewardRunner([slow])
        task = asyncio.create_task(runner.score_group(CHAT_ROW, TEXTS, IDS))
        await asyncio.sleep(0.05)  # the loop keeps running while `slow` waits
        assert not task.done()
        release.set()
        return await task

    assert asyncio.run(main()) == [[0.0, 0.0, 0.0]]


@pytest.mark.parametrize(
    "result, message",
    [
        ([1.0, 2.0], r"'bad' returned 2 scores for 3 completions"),
        ([1.0, "high", 0.0], r"'bad' returned 'high' for completion 1"),
        ("1.0", r"'bad' returned str"),
        (0.5, r"'bad' returned float"),
        ([1.0, float("inf"), 0.0], r"'bad' returned inf for completion 1"),
    ],
)
def test_unusable_outputs_are_errors_naming_the_function(result, message):
    def bad(prompts, completions, **kw):
        return result

    with pytest.raises(RewardFunctionError, match=message):
        score(RewardRunner([bad]))


def test_exceptions_propagate_as_reward_errors_with_the_cause_chained():
    async def broken(prompts, completions, **kw):
        raise ZeroDivisionError("division by zero in my verifier")

    with pytest.raises(RewardFunctionError, match=r"'broken' raised ZeroDivisionError") as info:
        score(RewardRunner([lambda prompts, completions, **kw: [0.0] * 3, broken]))
    assert isinstance(info.value, RewardFailure), "the orchestrator's failure type"
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_dotted_paths(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length_reward(prompts, completions, **kw):\n"
        "    return [float(len(c)) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    runner = RewardRunner(["my_rewards:length_reward", "asyncgrpo.testing.even_token_reward"])
    assert runner.names == ["length_reward", "even_token_reward"]
    plain = {"prompt": "q"}
    assert score(runner, plain, ["ab", "c"], [[2, 4], [1]]) == [[2.0, 1.0], [1.0, 0.0]]
    with pytest.raises(RewardSpecError, match=r"cannot import module 'no_such_module_xyz'"):
        RewardRunner(["no_such_module_xyz:f"])
    with pytest.raises(RewardSpecError, match=r"has no attribute 'lenght_reward'.*'length_reward'"):
        RewardRunner(["my_rewards:lenght_reward"])


def test_unknown_names_suggest_the_closest_builtin():
    with pytest.raises(RewardSpecError, match=r"did you mean 'word_count_reward'"):
        RewardRunner(["word_count_rewards"])
    with pytest.raises(RewardSpecError, match="no reward functions"):
        RewardRunner([])


def test_duplicate_names_are_made_unique():
    def f(prompts, completions, **kw):
        return [0.0] * len(completions)

    assert RewardRunner([f, f]).names == ["f", "f_2"]
