"""`trainer.gradient_checkpointing` recomputes activations, and changes nothing else:
the same batches give the same weights as without it."""

from __future__ import annotations

import torch

from asyncgrpo.base.config import RunConfig
from asyncgrpo.learning.rollout.types import Group, Rollout
from asyncgrpo.learning.trainer.build import load_policy, policy_trainer
from asyncgrpo.testing import save_tiny_model_dir


def groups() -> list[Group]:
    out = []
    for g in range(3):
        rollouts = [
            Rollout(
                [4 + g, 9, 11],
                [20 + i + g, 30 + i, 40, 41 + i][: 2 + i],
                [-1.0 - 0.1 * i] * (2 + i),
                [0] * (2 + i),
                "length",
                "",
                rewards=[float(i % 2)],
            )
            for i in range(3)
        ]
        out.append(Group(g, {}, rollouts))
    return out


def trained(model_dir, checkpointing: bool) -> tuple[torch.nn.Module, int]:
    cfg = RunConfig(
        model={"name_or_path": str(model_dir)},
        trainer={
            "gradient_checkpointing": checkpointing,
            "learning_rate": 1e-2,
            "bf16_autocast": False,
        },
        rewards=["asyncgrpo.testing.even_token_reward"],
    )
    model = load_policy(cfg, str(model_dir)).double()
    recomputed = 0

    def count(module, args):
        nonlocal recomputed
        recomputed += 1

    model.model.layers[0].mlp.register_forward_pre_hook(count)  # inside the checkpoint
    trainer = policy_trainer(cfg, model)
    for _ in range(2):
        trainer.step(groups())
    return model, recomputed


def test_same_weights_with_and_without_gradient_checkpointing(tmp_path):
    model_dir = save_tiny_model_dir(tmp_path / "model")
    plain, plain_calls = trained(model_dir, False)
    checkpointed, checkpointed_calls = trained(model_dir, True)
    # each checkpointed layer runs its forward again during backward
    assert checkpointed_calls == 2 * plain_calls > 0
    for (name, a), (_, b) in zip(
        plain.state_dict().items(), checkpointed.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(b, a, atol=1e-9, rtol=0, msg=name)
