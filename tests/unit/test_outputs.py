"""What a run writes keeps its promises: per-function rewards, samples.jsonl, the plain
progress lines, one evaluation per step across a resume, and plots that say what they show."""

from __future__ import annotations

import io
import json

import pytest

from asyncgrpo.base.loop_thread import LoopThread
from asyncgrpo.learning.coordinator.buffer import RolloutBuffer
from asyncgrpo.learning.metrics import MetricsTracker, ProgressDisplay, iter_jsonl, read_metrics
from asyncgrpo.learning.metrics.rows import StepRows
from asyncgrpo.learning.rollout.types import Group, Rollout
from asyncgrpo.run.evaluation import Evaluator


class TwoRewardBuilder:
    """The parts of a single-turn builder that StepRows and Evaluator read."""

    class rewards:  # noqa: N801 - stands for the builder's RewardRunner
        names = ["accuracy", "brevity"]

    def __init__(self):
        self.generated_tokens = 0
        self.evaluated: list[int] = []

    def take_stats(self) -> dict:
        return {}

    async def evaluate(self, rows: list[dict]) -> dict:
        self.evaluated.append(len(rows))
        return {"eval_reward_mean": 0.5, "eval_count": len(rows)}


def make_group(group_id: int, scores: list[tuple[float | None, float]]) -> Group:
    rollouts = [
        Rollout([1, 2], [3 + i], [-0.1], [0], "stop", f"answer {i}", rewards=list(pair))
        for i, pair in enumerate(scores)
    ]
    for r in rollouts:
        r.reward = sum(x for x in r.rewards if x is not None)
    prompt = [{"role": "user", "content": f"question {group_id}"}]
    return Group(group_id, {"prompt": prompt}, rollouts)


def consume(buffer: RolloutBuffer, groups: list[Group]) -> list[Group]:
    for g in groups:
        assert buffer.wait_admit(1)
        buffer.put(g)
    return buffer.get_batch(trainer_version=0, timeout=1)


def test_each_reward_function_gets_its_mean_and_every_sample_is_written(tmp_path):
    groups = [
        make_group(0, [(1.0, 0.2), (0.0, 0.4)]),
        make_group(1, [(None, 0.6), (1.0, 0.8)]),  # None: accuracy did not score it
    ]
    buffer = RolloutBuffer(batch_groups=2, max_staleness=1)
    with MetricsTracker(tmp_path) as tracker:
        rows = StepRows(tracker, buffer, TwoRewardBuilder())
        rows.log(1, {"reward_mean": 0.7}, consume(buffer, groups))
    (row,) = read_metrics(tmp_path)[0]
    assert row["reward/accuracy"] == pytest.approx(2 / 3)
    assert row["reward/brevity"] == pytest.approx(0.5)

    lines = list(iter_jsonl(tmp_path / "samples.jsonl"))
    assert [line["group_id"] for line in lines] == [0, 1]
    assert lines[1]["prompt"] == [{"role": "user", "content": "question 1"}]
    assert [s["completion"] for s in lines[1]["samples"]] == ["answer 0", "answer 1"]
    assert lines[1]["samples"][0]["rewards"] == {"accuracy": None, "brevity": 0.6}
    assert lines[1]["samples"][1]["reward"] == pytest.approx(1.8)
    assert lines[0]["samples"][0]["finish_reason"] == "stop"


def test_samples_per_group_keeps_the_first_completions(tmp_path):
    buffer = RolloutBuffer(batch_groups=1, max_staleness=0)
    with MetricsTracker(tmp_path) as tracker:
        rows = StepRows(tracker, buffer, TwoRewardBuilder(), samples_per_group=1)
        rows.log(1, {}, consume(buffer, [make_group(0, [(1.0, 0.0), (0.0, 1.0)])]))
    (line,) = iter_jsonl(tmp_path / "samples.jsonl")
    assert [s["completion"] for s in line["samples"]] == ["answer 0"]


def test_plain_progress_prints_every_step_with_the_last_held_out_reward(tmp_path):
    stream = io.StringIO()  # not a TTY
    progress = ProgressDisplay(3, stream=stream)
    buffer = RolloutBuffer(batch_groups=1, max_staleness=3)  # admits all three groups
    with MetricsTracker(tmp_path) as tracker:
        rows = StepRows(tracker, buffer, TwoRewardBuilder())
        for step in (1, 2, 3):
            if step == 2:
                tracker.log_eval(2, {"eval_reward_mean": 0.625})
            batch = consume(buffer, [make_group(step, [(1.0, 0.0), (0.0, 1.0)])])
            progress.update(step, rows.log(step, {"reward_mean": 0.5}, batch))
    lines = stream.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["step 1/3", "step 2/3", "step 3/3"]
    assert "held-out" not in lines[0]
    assert "held-out 0.625 @2" in lines[1] and "held-out 0.625 @2" in lines[2]
    # the held-out result goes to the progress line, not into the train rows
    assert all("eval_reward_mean" not in r for r in read_metrics(tmp_path)[0])


def test_a_resumed_run_does_not_evaluate_its_checkpoint_step_again(tmp_path):
    with MetricsTracker(tmp_path) as tracker:
        for step in (1, 2, 3, 4, 5):
            tracker.log_step(step, {"reward_mean": 0.1})
        tracker.log_eval(0, {"eval_reward_mean": 0.1})
        tracker.log_eval(4, {"eval_reward_mean": 0.3})
    loop = LoopThread()
    builder = TwoRewardBuilder()
    try:  # the checkpoint holds step 4, which was evaluated before the crash
        with MetricsTracker(tmp_path, resume_step=4) as tracker:
            evaluator = Evaluator(builder, [{"prompt": "p"}], loop, tracker, every=4)
            evaluator.maybe_start(4)
            evaluator.maybe_start(8, final=True)
    finally:
        loop.stop()
    evals = read_metrics(tmp_path)[1]
    assert [e["step"] for e in evals] == [0, 4, 8]
    assert builder.evaluated == [1]
    assert evals[-1]["eval_decoding"] == "greedy"


def test_staleness_plot_counts_the_drops_accounting_counts(tmp_path):
    pytest.importorskip("matplotlib")
    from asyncgrpo.learning.metrics.plots import plot_run, staleness_figure

    with MetricsTracker(tmp_path) as tracker:
        for step, dropped in ((1, 0), (2, 2), (3, 2), (4, 3)):  # run totals, not per step
            tracker.log_step(step, {"staleness_counts": {"0": 1, "1": 1}, "dropped_stale": dropped})
    accounting = {"admitted": 14, "consumed": 8, "dropped": {"stale": 5, "zero_variance": 1}}
    (tmp_path / "accounting.json").write_text(json.dumps(accounting))
    train, _ = read_metrics(tmp_path)
    title = staleness_figure(train, accounting).axes[0].get_title()
    assert "dropped as too stale: 5" in title and "other drops: 1" in title
    assert "8 trained" in title
    # without accounting.json: the last row's run total, not the sum of the rows
    assert "dropped as too stale: 3" in staleness_figure(train).axes[0].get_title()
    assert (tmp_path / "plots" / "staleness.png") in plot_run(tmp_path)


def _legend(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_pipeline_plot_labels_every_axis_and_separates_staleness_from_the_queue():
    pytest.importorskip("matplotlib")
    from asyncgrpo.learning.metrics.plots import pipeline_figure

    train = [
        {
            "step": s,
            "gen_tokens_per_s": 200.0,
            "train_tokens_per_s": 150.0,
            "engine_busy_ratio": 0.8,
            "trainer_idle_ratio": 0.1,
            "staleness_mean": 0.5,
            "staleness_max": 1,
            "queue_size": 3,
            "in_flight": 4,
        }
        for s in range(1, 6)
    ]
    axes = pipeline_figure(train).axes
    assert all(ax.get_ylabel() for ax in axes)
    by_title = {ax.get_title(): ax for ax in axes}
    stale, buffer = by_title["staleness of the trained groups"], by_title["rollout buffer"]
    assert stale is not buffer
    assert _legend(stale) == ["mean", "max"]
    assert _legend(buffer) == ["queued (ready to train)", "in flight (being generated)"]
    mean_line, max_line = stale.get_lines()
    assert (mean_line.get_linestyle(), mean_line.get_marker()) != (
        max_line.get_linestyle(),
        max_line.get_marker(),
    )
    legends = [name for ax in axes for name in _legend(ax)]
    assert not [name for name in legends if "_" in name], "metric keys as legend names"


def test_reward_plot_says_held_out_is_greedy_and_train_is_sampled():
    pytest.importorskip("matplotlib")
    from asyncgrpo.learning.metrics.plots import reward_figure

    train = [
        {"step": s, "time_s": 2.0 * s, "reward_mean": 0.1 * s, "reward_std": 0.1} for s in (1, 2)
    ]
    evals = [{"step": 2, "time_s": 4.5, "eval_reward_mean": 0.3, "eval_decoding": "greedy"}]
    for ax in reward_figure(train, evals).axes:
        names = _legend(ax)
        assert "train, sampled: mean" in names and "held-out, greedy: mean" in names
