"""Checkpoints restore model, optimizer, scheduler, RNG and scalars exactly; writes are atomic;
each one carries the run's accounting, which `accounting.json` mirrors."""

import json
import random

import numpy as np
import pytest
import torch

from asyncgrpo.learning.trainer.checkpoint import (
    Checkpointer,
    TrainingState,
    copy_weights,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    write_weights,
)
from asyncgrpo.testing import build_tiny_llama


def make(seed=0):
    model = build_tiny_llama(64, seed=seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return model, opt, sched


def train_step(model, opt, sched, ids):
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    return loss.item()


def test_resume_continues_identically(tmp_path):
    ids = torch.randint(0, 64, (2, 12))
    model, opt, sched = make()
    for _ in range(2):
        train_step(model, opt, sched, ids)
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(9)
    state = TrainingState(step=2, version=2, data_position={"epoch": 0, "index": 8}, extra={"a": 1})
    path = save_checkpoint(tmp_path, model, opt, sched, state)
    expected_rng = (torch.rand(3), random.random(), np.random.rand())
    expected_losses = [train_step(model, opt, sched, ids) for _ in range(2)]

    model2, opt2, sched2 = make(seed=1)  # different init: everything must come from disk
    assert latest_checkpoint(tmp_path) == path
    restored = load_checkpoint(path, model2, opt2, sched2)
    assert restored == state
    got_rng = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got_rng[0], expected_rng[0]) and got_rng[1:] == expected_rng[1:]
    assert [train_step(model2, opt2, sched2, ids) for _ in range(2)] == expected_losses


def test_keeps_last_checkpoints_and_ignores_partial_writes(tmp_path):
    model, opt, sched = make()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, model, opt, sched, TrainingState(step, step, {}, {}), keep=2)
    names = sorted(p.name for p in tmp_path.glob("step-*"))
    assert names == ["step-000002", "step-000003"]
    # a crash mid-write leaves a temp dir that is never picked up
    (tmp_path / ".tmp-step-000004").mkdir()
    assert latest_checkpoint(tmp_path).name == "step-000003"


def test_weight_snapshot_in_the_engine_dtype_is_a_detached_rounded_copy(tmp_path):
    from safetensors.torch import load_file

    model = build_tiny_llama(64, seed=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: stored once
    before = {k: v.clone() for k, v in model.state_dict().items()}
    snapshot = copy_weights(model, torch.bfloat16)
    with torch.no_grad():  # training goes on after the copy
        for p in model.parameters():
            p.add_(1.0)
    write_weights(tmp_path / "step.safetensors", snapshot)
    saved = load_file(tmp_path / "step.safetensors")
    assert "lm_head.weight" not in saved and "model.embed_tokens.weight" in saved
    for name, tensor in saved.items():
        assert tensor.dtype == torch.bfloat16
        # round-to-nearest of the weights at copy time, not of the weights trained since
        assert torch.equal(tensor, before[name].to(torch.bfloat16)), name


class TinyTrainer:
    """The checkpoint half of a `Trainer`, on the real save and load functions."""

    def __init__(self):
        self.model, self.optimizer, self.scheduler = make()
        self.version = 0

    def save_checkpoint(self, directory, state):
        return save_checkpoint(directory, self.model, self.optimizer, self.scheduler, state)

    def load_checkpoint(self, path):
        state = load_checkpoint(path, self.model, self.optimizer, self.scheduler)
        self.version = state.version
        return state


def test_each_checkpoint_carries_the_accounting_and_rewrites_accounting_json(tmp_path):
    trainer = TinyTrainer()
    checkpoints = Checkpointer(trainer, tmp_path, every=2, snapshot_every=None, snapshot_dtype=None)
    asked = []

    def progress():
        asked.append(trainer.version)
        return {"cursor": 4 * trainer.version}, {"consumed": 2 * trainer.version, "dropped": {}}

    for step in (1, 2, 3):
        trainer.version = step
        checkpoints.maybe_save(step, progress, time_s=float(step))
    checkpoints.close()
    assert asked == [2]  # the progress (a round trip to the rollout loop) only when due
    accounting = json.loads((tmp_path / "accounting.json").read_text())
    assert accounting == {"consumed": 4, "dropped": {}}
    assert not list(tmp_path.glob(".tmp-*")), "the temporary file was left behind"

    resumed = TinyTrainer()
    state = Checkpointer(resumed, tmp_path, 2, None, None).resume()
    assert (state.step, resumed.version, state.data_position) == (2, 2, {"cursor": 8})
    assert state.extra == {"time_s": 2.0, "accounting": accounting}


def test_a_snapshot_that_cannot_be_written_is_logged_and_training_goes_on(
    tmp_path, monkeypatch, caplog
):
    """A full disk fails one weight snapshot: no traceback ends the run, no temporary
    file is left, and the next snapshot is written once there is room again."""
    from safetensors import SafetensorError

    from asyncgrpo.learning.trainer import checkpoint

    real_save = checkpoint.save_file

    def disk_full(weights, path):  # what safetensors raised when /tmp filled up
        path.write_bytes(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device")

    trainer = TinyTrainer()
    trainer.named_weights = lambda: trainer.model.state_dict().items()
    snapshots = Checkpointer(trainer, tmp_path, 1000, 1, torch.float32)
    monkeypatch.setattr(checkpoint, "save_file", disk_full)
    snapshots.maybe_save(1, lambda: ({}, {}), time_s=1.0)
    snapshots.wait()
    assert "step-000001.safetensors not written" in caplog.text
    assert "No space left on device" in caplog.text
    monkeypatch.setattr(checkpoint, "save_file", real_save)
    snapshots.maybe_save(2, lambda: ({}, {}), time_s=2.0)
    snapshots.close()
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["step-000002.safetensors"]


def test_a_checkpoint_that_cannot_be_written_leaves_the_previous_one_and_says_so(
    tmp_path, monkeypatch, caplog
):
    """A full disk fails the optimizer file of step 4's checkpoint: no half checkpoint is
    left, `latest` still names step 2's, training goes on; the run's last checkpoint
    failing the same way raises `CheckpointNotWritten` naming both."""
    from safetensors import SafetensorError

    from asyncgrpo.learning.trainer import checkpoint

    real_save = checkpoint.save_file

    def full_after_weights(tensors, path):
        if path.name == "optimizer.safetensors":
            path.write_bytes(b"partial")
            raise SafetensorError("Error while serializing: I/O error: No space left on device")
        real_save(tensors, path)

    trainer = TinyTrainer()
    checkpoints = Checkpointer(trainer, tmp_path, every=2, snapshot_every=None, snapshot_dtype=None)
    progress = lambda: ({"cursor": trainer.version}, {"consumed": trainer.version})  # noqa: E731
    trainer.version = 2
    checkpoints.maybe_save(2, progress, time_s=2.0)
    monkeypatch.setattr(checkpoint, "save_file", full_after_weights)
    trainer.version = 4
    checkpoints.maybe_save(4, progress, time_s=4.0)
    assert "checkpoint of step 4 not written" in caplog.text
    assert "No space left on device" in caplog.text and "step-000002" in caplog.text
    directory = tmp_path / "checkpoints"
    assert sorted(p.name for p in directory.iterdir()) == ["latest", "step-000002"]
    assert json.loads((tmp_path / "accounting.json").read_text()) == {"consumed": 2}
    with pytest.raises(checkpoint.CheckpointNotWritten, match="step 5 not written.*step-000002"):
        checkpoints.maybe_save(5, progress, time_s=5.0, force=True)
    monkeypatch.setattr(checkpoint, "save_file", real_save)
    resumed = TinyTrainer()
    assert Checkpointer(resumed, tmp_path, 2, None, None).resume().step == 2
