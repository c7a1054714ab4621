"""Run-directory metrics: JSONL record, aggregation, resume truncation, timeline ratios, progress."""

from __future__ import annotations

import io
import json
import math
import sys

import numpy as np
import pytest
import torch

from asyncgrpo.learning.metrics import (
    Interval,
    MetricsTracker,
    ProgressDisplay,
    Timeline,
    aggregate_metrics,
    count_values,
    engine_busy_ratio,
    iter_jsonl,
    make_sinks,
    merge_intervals,
    read_metrics,
    read_timeline,
    to_jsonable,
    trainer_idle_ratio,
)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# --------------------------------------------------------------------------- JSONL record


def test_jsonl_round_trip_nan_inf_and_array_scalars(tmp_path):
    with MetricsTracker(tmp_path) as tracker:
        tracker.log_step(
            1,
            {
                "reward_mean": np.float32(0.5),
                "version": np.int64(3),
                "loss": torch.tensor(0.25),
                "clip_ratio": float("nan"),
                "is_weight_mean": float("inf"),
                "staleness_counts": {0: np.int64(5), 1: 2},
                "lengths": np.array([1, 2]),
            },
        )
        tracker.log_eval(1, {"eval_reward_mean": 0.75})
    raw = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in raw and "Infinity" not in raw
    step, ev = _lines(tmp_path / "metrics.jsonl")
    assert step["kind"] == "train" and step["step"] == 1 and step["time_s"] >= 0
    assert step["reward_mean"] == 0.5 and step["version"] == 3 and step["loss"] == 0.25
    assert step["clip_ratio"] is None and step["is_weight_mean"] is None
    assert step["staleness_counts"] == {"0": 5, "1": 2}
    assert step["lengths"] == [1, 2]
    assert ev["kind"] == "eval" and ev["eval_reward_mean"] == 0.75
    train, evals = read_metrics(tmp_path)
    assert [r["step"] for r in train] == [1] and [r["step"] for r in evals] == [1]


def test_to_jsonable_types():
    assert to_jsonable({"a": (1, np.float64(-math.inf)), 2: None}) == {"a": [1, None], "2": None}
    assert to_jsonable(np.bool_(True)) is True


def test_torn_last_line_is_skipped_on_read_and_cut_on_reopen(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsTracker(tmp_path) as tracker:
        tracker.log_step(1, {"reward_mean": 0.1})
    with path.open("a") as f:
        f.write('{"kind":"train","step":2,"rew')  # what kill -9 mid-write leaves
    assert [r["step"] for r in iter_jsonl(path)] == [1]
    with MetricsTracker(tmp_path) as tracker:
        tracker.log_step(2, {"reward_mean": 0.2})
    assert [r["step"] for r in _lines(path)] == [1, 2]


def test_samples_file(tmp_path):
    with MetricsTracker(tmp_path) as tracker:
        tracker.log_samples(4, [{"prompt": "1+1", "completion": "2", "reward": 1.0}])
    (row,) = _lines(tmp_path / "samples.jsonl")
    assert row == {"step": 4, "prompt": "1+1", "completion": "2", "reward": 1.0}


# --------------------------------------------------------------------------- aggregation


def test_aggregate_union_of_keys_nan_aware():
    rows = [
        {"reward/a": 1.0, "len": 10},  # no reward/b: the anchors would drop it
        {"reward/a": float("nan"), "reward/b": 0.0, "len": 20},
        {"reward/a": 3.0, "reward/b": None, "len": np.int64(30), "tool_calls": 2},
        {"reward/b": 1.0, "only_nan": float("nan"), "name": "x", "lens": [1, 2]},
    ]
    out = aggregate_metrics(rows, reduce={"tool_calls": "sum", "len": "max"})
    assert list(out) == ["reward/a", "len", "reward/b", "tool_calls", "only_nan"]
    assert out["reward/a"] == pytest.approx(2.0)  # (1 + 3) / 2, NaN ignored
    assert out["reward/b"] == pytest.approx(0.5)  # (0 + 1) / 2, None ignored
    assert out["len"] == 30 and out["tool_calls"] == 2
    assert math.isnan(out["only_nan"])
    with pytest.raises(ValueError, match="median"):
        aggregate_metrics(rows, reduce={"len": "median"})


def test_count_values():
    assert count_values([0, 1, 0, 2, np.int64(0)]) == {"0": 3, "1": 1, "2": 1}


# --------------------------------------------------------------------------- resume


def test_truncate_after_drops_later_steps_and_continues_clock(tmp_path):
    with MetricsTracker(tmp_path) as tracker:
        for step in range(1, 6):
            tracker.log_step(step, {"time_s": 10.0 * step, "reward_mean": step})
            tracker.log_samples(step, [{"completion": str(step)}])
        tracker.log_eval(3, {"time_s": 30.0, "eval_reward_mean": 0.3})
        tracker.timeline.record("trainer", 5.0, 25.0)
        tracker.timeline.record("engine", 28.0, 45.0)  # straddles t=30
        tracker.timeline.record("engine", 41.0, 50.0)  # after t=30
    with MetricsTracker(tmp_path, resume_step=3) as tracker:
        assert 30.0 <= tracker.elapsed() < 31.0
        tracker.log_step(4, {"reward_mean": 40})
    rows = _lines(tmp_path / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in rows] == [
        ("train", 1),
        ("train", 2),
        ("train", 3),
        ("eval", 3),
        ("train", 4),
    ]
    assert rows[-1]["reward_mean"] == 40 and rows[-1]["time_s"] >= 30.0
    assert [r["step"] for r in _lines(tmp_path / "samples.jsonl")] == [1, 2, 3]
    spans = sorted((i.role, i.start_s, i.end_s) for i in read_timeline(tmp_path / "timeline.jsonl"))
    assert spans == [("engine", 28.0, 30.0), ("trainer", 5.0, 25.0)]


def test_truncate_mid_process_discards_intervals_on_the_old_clock(tmp_path):
    with MetricsTracker(tmp_path) as tracker:
        tracker.log_step(1, {"time_s": 100.0})
        tracker.log_step(2, {"time_s": 200.0})
        tracker.timeline.record("engine", 150.0, 160.0)
    with MetricsTracker(tmp_path) as tracker:  # e.g. the pipeline resumes after start-up
        tracker.timeline.record("engine", 0.0, 0.5)  # start-up work, on the new process clock
        tracker.timeline.begin("trainer")
        tracker.truncate_after(1)
        assert 100.0 <= tracker.elapsed() < 101.0
        tracker.timeline.end("trainer")
    spans = sorted((i.role, i.start_s) for i in read_timeline(tmp_path / "timeline.jsonl"))
    assert [role for role, _ in spans] == ["trainer"]
    assert 100.0 <= spans[0][1] < 101.0


def test_overwrite_starts_empty(tmp_path):
    with MetricsTracker(tmp_path) as tracker:
        tracker.log_step(1, {})
    with MetricsTracker(tmp_path, overwrite=True) as tracker:
        tracker.log_step(7, {})
    assert [r["step"] for r in _lines(tmp_path / "metrics.jsonl")] == [7]


# --------------------------------------------------------------------------- timeline ratios


def test_merge_intervals():
    assert merge_intervals([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9)]) == [(0, 4), (5, 7)]


def test_ratios_hand_computed():
    iv = [
        Interval("engine", 0, 4),
        Interval("engine", 2, 6),  # overlaps: engine busy [0, 6]
        Interval("engine", 8, 12),
        Interval("trainer", 3, 5),
        Interval("weight_sync", 5, 6),  # trainer side busy [3, 6]
        Interval("trainer", 9, 11),
    ]
    # window [0, 10]: engine busy 6 + 2 = 8; trainer busy 3 + 1 = 4
    assert engine_busy_ratio(iv, 0, 10) == pytest.approx(0.8)
    assert trainer_idle_ratio(iv, 0, 10) == pytest.approx(0.6)
    # window [4, 9]: engine [4,6] + [8,9] = 3 of 5; trainer [4,6] + [9,9] = 2 of 5
    assert engine_busy_ratio(iv, 4, 9) == pytest.approx(0.6)
    assert trainer_idle_ratio(iv, 4, 9) == pytest.approx(0.6)
    assert math.isnan(engine_busy_ratio(iv, 3, 3))


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_timeline_concurrent_spans_merge_and_open_spans_are_cut():
    clock = FakeClock()
    timeline = Timeline(clock)
    timeline.begin("engine")  # t=0: request 1
    clock.t = 2.0
    timeline.begin("engine")  # t=2: request 2 overlaps
    clock.t = 3.0
    timeline.end("engine")  # request 1 done; still busy
    with timeline.span("trainer"):
        clock.t = 5.0
    clock.t = 10.0
    ratios = timeline.ratios(0.0)  # engine still open -> counts up to now and is cut
    assert ratios["engine_busy_ratio"] == pytest.approx(1.0)
    assert ratios["trainer_idle_ratio"] == pytest.approx(0.8)
    clock.t = 12.0
    timeline.end("engine")
    clock.t = 20.0
    ratios = timeline.ratios(10.0)
    assert ratios["engine_busy_ratio"] == pytest.approx(0.2)
    assert ratios["trainer_idle_ratio"] == pytest.approx(1.0)
    with pytest.raises(RuntimeError):
        timeline.end("engine")


class ServerInfo:
    """A client whose `server_info` reports `stats` (or none, as vLLM's)."""

    def __init__(self, stats):
        self.stats, self.calls = stats, 0

    async def server_info(self):
        self.calls += 1
        info = {"weight_version": 0}
        if self.stats is not None:
            info["stats"] = {"busy_seconds": self.stats * self.calls}  # busy all the time
        return info


@pytest.mark.parametrize("reports", [True, False])
def test_engine_busy_is_unknown_not_zero_when_the_engine_does_not_report_it(reports):
    import asyncio
    from types import SimpleNamespace

    from asyncgrpo.run.session.engine_link import record_engine_busy

    clock = FakeClock()
    tracker = SimpleNamespace(timeline=Timeline(clock), elapsed=clock)
    client = ServerInfo(0.01 if reports else None)

    async def watch():
        task = asyncio.create_task(record_engine_busy(client, tracker, period=0.01))
        for _ in range(20):
            clock.t += 0.01
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(watch())
    busy = tracker.timeline.ratios(0.0)["engine_busy_ratio"]
    if reports:
        assert busy > 0
    else:
        assert math.isnan(busy) and client.calls == 1  # asked once, then left alone


def test_tracker_span_writes_timeline(tmp_path):
    with MetricsTracker(tmp_path) as tracker:
        with tracker.span("trainer"):
            pass
        tracker.timeline.begin("engine")  # left open: closed by close()
    roles = sorted(i.role for i in read_timeline(tmp_path / "timeline.jsonl"))
    assert set(roles) <= {"engine", "trainer"}  # zero-length spans may be skipped
    assert all(i.end_s >= i.start_s for i in read_timeline(tmp_path / "timeline.jsonl"))


# --------------------------------------------------------------------------- sinks, progress


def test_missing_optional_sink_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    with pytest.raises(ImportError, match=r"asyncgrpo\[wandb\]"):
        make_sinks(["wandb"], tmp_path)
    with pytest.raises(ValueError, match="unknown sink"):
        make_sinks(["mlflow"], tmp_path)


def test_sinks_receive_flat_scalars(tmp_path):
    class Recorder:
        def __init__(self):
            self.calls = []

        def log(self, step, metrics, kind):
            self.calls.append((step, kind, metrics))

        def close(self):
            self.calls.append("closed")

    sink = Recorder()
    with MetricsTracker(tmp_path, sinks=[sink]) as tracker:
        tracker.log_step(
            2,
            {
                "time_s": 1.0,
                "loss": float("nan"),
                "reward/acc": 1,
                "note": "x",
                "staleness_counts": {"0": 3},
            },
        )
    step, kind, metrics = sink.calls[0]
    assert (step, kind) == (2, "train") and sink.calls[-1] == "closed"
    assert metrics == {"time_s": 1.0, "reward/acc": 1.0, "staleness_counts/0": 3.0}


def test_progress_plain_lines_when_not_a_tty():
    stream = io.StringIO()  # not a TTY
    clock = FakeClock()
    progress = ProgressDisplay(10, stream=stream, log_every_steps=3, clock=clock)
    metrics = {
        "reward_mean": 0.5,
        "staleness_mean": 0.75,
        "staleness_max": 2,
        "gen_tokens_per_s": 210.4,
        "train_tokens_per_s": 140.0,
    }
    for step in range(1, 11):
        clock.t = 10.0 * step
        progress.update(step, metrics)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    # the first step, every third step, and the last step
    assert [line.split("|")[0].strip() for line in lines] == [
        "step  1/10",
        "step  3/10",
        "step  6/10",
        "step  9/10",
        "step 10/10",
    ]
    assert lines[0] == (
        "step  1/10 | reward 0.500 | stale 0.8/2 | gen 210 tok/s | train 140 tok/s | eta 1m30s"
    )
    assert lines[-1].endswith("eta 0s")


def test_progress_live_bar_on_a_tty():
    stream = io.StringIO()
    progress = ProgressDisplay(5, start_step=2, stream=stream, live=True)
    for step in range(3, 6):
        progress.update(step, {"reward_mean": 0.25, "staleness_mean": 1.0, "staleness_max": 1})
    progress.write("a message")
    progress.close()
    out = stream.getvalue()
    assert "5/5" in out and "reward 0.250" in out and "a message" in out
