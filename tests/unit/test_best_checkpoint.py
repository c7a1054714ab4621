"""The best evaluation's weights are kept, bit for bit, and a worse or broken one changes nothing."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from asyncgrpo.base.config import RunConfig
from asyncgrpo.learning.trainer.best import BestKeeper, best_summary, improves, read_best
from asyncgrpo.run.export import pick_weights


class FakeTrainer:
    """Weights that move at every `step()`, as a trainer's do while an evaluation runs."""

    def __init__(self):
        self.w = torch.zeros(3, 2)

    def named_weights(self, dtype=None):
        yield "layer.weight", self.w

    def step(self):
        with torch.no_grad():
            self.w += 1.0


def kept(run_dir) -> torch.Tensor:
    return load_file(run_dir / "best" / "model.safetensors")["layer.weight"]


def test_the_weights_kept_are_those_of_the_evaluated_step_not_of_the_step_it_ended_at(tmp_path):
    trainer, keeper = FakeTrainer(), None
    keeper = BestKeeper(trainer, tmp_path, "eval_reward_mean")
    keeper.evaluation_started(0)
    trainer.step()  # training goes on while the evaluation runs
    keeper.evaluation_logged(0, {"step": 0, "eval_reward_mean": 0.2})
    assert torch.equal(kept(tmp_path), torch.zeros(3, 2))
    keeper.evaluation_started(1)
    trainer.step()
    trainer.step()
    keeper.evaluation_logged(1, {"step": 1, "eval_reward_mean": 0.5})
    assert torch.equal(kept(tmp_path), torch.ones(3, 2))
    assert read_best(tmp_path) == {
        "step": 1,
        "metric": "eval_reward_mean",
        "value": 0.5,
        "mode": "max",
    }


@pytest.mark.parametrize(
    "row",
    [
        {"eval_reward_mean": 0.1},  # worse
        {"eval_reward_mean": 0.5},  # a tie keeps the earlier step
        {"eval_reward_mean": math.nan},
        {"eval_other": 9.0},  # the metric missing
        None,  # the evaluation failed to log
    ],
)
def test_a_worse_tied_or_unreadable_evaluation_leaves_the_best_alone(tmp_path, row):
    trainer = FakeTrainer()
    keeper = BestKeeper(trainer, tmp_path, "eval_reward_mean")
    keeper.evaluation_started(2)
    keeper.evaluation_logged(2, {"eval_reward_mean": 0.5})
    trainer.step()
    keeper.evaluation_started(4)
    keeper.evaluation_logged(4, row)
    assert read_best(tmp_path)["step"] == 2
    assert torch.equal(kept(tmp_path), torch.zeros(3, 2))


def test_a_result_for_another_step_than_the_copy_is_not_kept(tmp_path):
    keeper = BestKeeper(FakeTrainer(), tmp_path, "eval_reward_mean")
    keeper.evaluation_started(3)
    keeper.evaluation_failed()
    keeper.evaluation_logged(3, {"eval_reward_mean": 1.0})  # no copy left to keep
    keeper.evaluation_started(5)
    keeper.evaluation_logged(6, {"eval_reward_mean": 1.0})
    assert read_best(tmp_path) is None


def test_a_resumed_run_compares_against_the_best_it_kept_and_min_mode_prefers_smaller(tmp_path):
    trainer = FakeTrainer()
    first = BestKeeper(trainer, tmp_path, "eval_loss_like", mode="min")
    first.evaluation_started(10)
    first.evaluation_logged(10, {"eval_loss_like": 0.3})
    resumed = BestKeeper(trainer, tmp_path, "eval_loss_like", mode="min")
    trainer.step()
    resumed.evaluation_started(12)
    resumed.evaluation_logged(12, {"eval_loss_like": 0.4})  # larger: worse in min mode
    assert read_best(tmp_path)["step"] == 10
    resumed.evaluation_started(14)
    resumed.evaluation_logged(14, {"eval_loss_like": 0.25})
    assert read_best(tmp_path)["step"] == 14
    assert torch.equal(kept(tmp_path), torch.ones(3, 2))
    other_metric = BestKeeper(trainer, tmp_path, "eval_reward_mean")  # another metric: anew
    assert other_metric.best is None


def test_improves_and_the_summary_line():
    assert improves(0.3, None, "max") and improves(0.4, 0.3, "max")
    assert not improves(0.3, 0.3, "max") and improves(0.2, 0.3, "min")


def test_the_run_summary_names_the_best_step_and_how_far_the_last_fell(tmp_path):
    assert best_summary(tmp_path, {"step": 50, "eval_reward_mean": 0.5}) is None
    keeper = BestKeeper(FakeTrainer(), tmp_path, "eval_reward_mean")
    keeper.evaluation_started(40)
    keeper.evaluation_logged(40, {"eval_reward_mean": 0.835})
    line = best_summary(tmp_path, {"step": 50, "eval_reward_mean": 0.588})
    assert line == (
        "best eval_reward_mean 0.835 at step 40; the last evaluation, step 50: 0.588 (-0.247)"
    )
    same = best_summary(tmp_path, {"step": 40, "eval_reward_mean": 0.835})
    assert same == "best eval_reward_mean 0.835 at step 40, the last evaluation"


def test_export_picks_the_best_unless_asked_for_the_last_or_a_step(tmp_path):
    snapshots = tmp_path / "weights"
    snapshots.mkdir()
    for step in (2, 4):
        (snapshots / f"step-{step:06d}.safetensors").write_bytes(b"")
    assert pick_weights(tmp_path, None) == (4, snapshots / "step-000004.safetensors")
    keeper = BestKeeper(FakeTrainer(), tmp_path, "eval_reward_mean")
    keeper.evaluation_started(3)
    keeper.evaluation_logged(3, {"eval_reward_mean": 0.9})
    assert pick_weights(tmp_path, None) == (3, tmp_path / "best" / "model.safetensors")
    assert pick_weights(tmp_path, None, last=True)[0] == 4
    assert pick_weights(tmp_path, 2)[0] == 2


def test_trl_names_for_the_best_model_map_onto_the_best_checkpoint():
    from asyncgrpo import AsyncGRPOConfig

    default = RunConfig()
    assert (default.best_checkpoint_metric, default.best_checkpoint_mode) == (
        "eval_reward_mean",
        "max",
    )
    cfg = AsyncGRPOConfig(load_best_model_at_end=True, metric_for_best_model="reward")
    assert cfg.best_checkpoint_metric == "eval_reward_mean"
    cfg = AsyncGRPOConfig(metric_for_best_model="eval_format_reward", greater_is_better=False)
    assert (cfg.best_checkpoint_metric, cfg.best_checkpoint_mode) == ("eval_format_reward", "min")
    off = AsyncGRPOConfig(load_best_model_at_end=False, metric_for_best_model="reward")
    assert off.best_checkpoint_metric is None
    with pytest.raises(Exception, match="not a loss"):
        AsyncGRPOConfig(load_best_model_at_end=True, metric_for_best_model="loss")


def test_the_record_is_json_a_reader_can_use(tmp_path):
    keeper = BestKeeper(FakeTrainer(), tmp_path, "eval_reward_mean")
    keeper.evaluation_started(7)
    keeper.evaluation_logged(7, {"eval_reward_mean": 1})
    assert json.loads((tmp_path / "best" / "best.json").read_text())["value"] == 1.0
