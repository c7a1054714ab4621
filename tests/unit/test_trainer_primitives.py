"""The trainer's primitives (`forward`, `forward_backward`, `optim_step`) against plain references.

`forward` against an unpacked Hugging Face forward and a log-softmax gather (eager
attention, one sequence at a time); accumulation over calls against one call; an
`AdamParams` step against `torch.optim.AdamW` built by hand on a copy of the model.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from asyncgrpo.base.config import AdvantageConfig, LossConfig, TrainerConfig
from asyncgrpo.learning.trainer.datums import AdamParams, MicroBatch, TrainDatum
from asyncgrpo.learning.trainer.packing import packed_token_logprobs
from asyncgrpo.learning.trainer.policy_trainer import PolicyTrainer
from asyncgrpo.testing import build_tiny_llama

VOCAB = 64


def make_trainer(seed: int = 0, budget: int = 32) -> PolicyTrainer:
    """A tiny fp32 trainer whose token budget cuts the test batches into several packs."""
    return PolicyTrainer(
        build_tiny_llama(VOCAB, seed=seed),
        TrainerConfig(bf16_autocast=False, micro_batch_tokens=budget),
        LossConfig(),
        AdvantageConfig(),
        max_steps=10,
    )


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def datums(explicit_targets: bool, seed: int = 0) -> list[TrainDatum]:
    """Two completions behind one prompt (a group), sequences alone, a Tinker-style datum
    (targets from position 1) and one with no target at all."""
    prompt = random_ids(6, seed)
    layouts = [  # (tokens, loss_start, group)
        (prompt + random_ids(5, seed + 1), 6, "g"),
        (prompt + random_ids(9, seed + 2), 6, "g"),
        (random_ids(14, seed + 3), 4, None),
        (random_ids(12, seed + 4), 1, None),
        (random_ids(20, seed + 5), 11, None),
        (random_ids(7, seed + 6), 7, None),  # nothing to predict
    ]
    out = []
    for k, (tokens, start, group) in enumerate(layouts):
        n = len(tokens) - start
        targets = random_ids(n, seed + 100 + k) if explicit_targets else None
        weights = torch.linspace(-0.5, 1.5, n)  # Tinker's weights may be negative
        out.append(TrainDatum(tokens, start, targets, {"weights": weights}, group=group))
    return out


def plain_logprobs(model: torch.nn.Module, datum: TrainDatum) -> torch.Tensor:
    """log_softmax of an ordinary forward of the one sequence, gathered at its targets."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([datum.tokens])).logits[0].float()  # (L, V)
    positions = torch.arange(datum.loss_start - 1, len(datum.tokens) - 1)
    targets = datum.targets if datum.targets is not None else datum.tokens[datum.loss_start :]
    return torch.log_softmax(logits, dim=-1)[positions, torch.tensor(targets, dtype=torch.long)]


@pytest.mark.parametrize("explicit_targets", [False, True], ids=["shifted", "arbitrary"])
def test_forward_equals_a_plain_forward_and_gather(explicit_targets):
    trainer = make_trainer()
    plain = build_tiny_llama(VOCAB, seed=0)
    plain.set_attn_implementation("eager")
    batch = datums(explicit_targets)
    got = trainer.forward(batch)
    assert [len(lp) for lp in got] == [d.num_targets for d in batch]
    for datum, logprobs in zip(batch, got, strict=True):
        torch.testing.assert_close(logprobs, plain_logprobs(plain, datum), atol=2e-5, rtol=0)
        assert logprobs.dtype == torch.float32


def test_with_explicit_targets_the_last_token_is_never_read():
    trainer = make_trainer()
    batch = datums(explicit_targets=True)
    other = [
        dataclasses.replace(d, tokens=d.tokens[:-1] + [(d.tokens[-1] + 1) % VOCAB]) for d in batch
    ]
    for a, b in zip(trainer.forward(batch), trainer.forward(other), strict=True):
        assert torch.equal(a, b)


def test_packed_targets_must_match_the_completion_positions():
    model = build_tiny_llama(VOCAB)
    with pytest.raises(ValueError, match=r"targets\[1\] has 2 tokens for 3"):
        packed_token_logprobs(
            model, [[1, 2, 3], [4, 5, 6, 7]], [1, 1], attention="mask", targets=[None, [1, 2]]
        )


def test_forward_changes_nothing():
    trainer = make_trainer()
    before = copy.deepcopy(trainer.model.state_dict())
    trainer.forward(datums(explicit_targets=False))
    assert trainer.version == 0
    assert all(p.grad is None for p in trainer.model.parameters())
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, before[name]), name


def weighted_nll(total_tokens: float):
    """−Σ logprob·weight over the loss tokens, divided by the whole step's token count."""

    def loss(batch: MicroBatch):
        per_token = -batch.logprobs * batch.inputs["weights"] * batch.mask  # (B, T)
        return per_token.sum() / total_tokens, {
            "weight_mean": float(batch.inputs["weights"].mean())
        }

    return loss


def gradients(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def test_forward_backward_accumulates_across_calls_exactly():
    first, second = datums(False, seed=0), datums(True, seed=7)
    total = float(sum(d.num_targets for d in first + second))
    split, whole = make_trainer(), make_trainer()
    a = split.forward_backward(first, weighted_nll(total))
    b = split.forward_backward(second, weighted_nll(total))
    both = whole.forward_backward(first + second, weighted_nll(total))
    assert a.loss + b.loss == pytest.approx(both.loss, rel=1e-6)
    assert a.loss_tokens + b.loss_tokens == both.loss_tokens == total
    torch.testing.assert_close(gradients(split), gradients(whole), atol=1e-7, rtol=1e-5)
    # the loss is what it says: −Σ logprob·weight / tokens, from the plain forward
    plain = build_tiny_llama(VOCAB, seed=0)
    by_hand = -sum(
        float((plain_logprobs(plain, d) * d.inputs["weights"]).sum()) for d in first + second
    )
    assert both.loss == pytest.approx(by_hand / total, rel=1e-4)
    # the per-datum log-probs are forward's
    for got, expected in zip(a.logprobs + b.logprobs, split.forward(first + second), strict=True):
        torch.testing.assert_close(got, expected)
    split.optim_step(), whole.optim_step()
    for p, q in zip(split.model.parameters(), whole.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    assert split.version == whole.version == 1


def test_a_mask_input_removes_positions_from_the_loss_and_the_count():
    trainer = make_trainer()
    datum = datums(False)[2]
    keep = torch.tensor([1.0, 0.0] * (datum.num_targets // 2))
    masked = TrainDatum(datum.tokens, datum.loss_start, None, {**datum.inputs, "mask": keep})
    result = trainer.forward_backward([masked], weighted_nll(1.0))
    expected = -(trainer.forward([datum])[0] * datum.inputs["weights"] * keep).sum()
    assert result.loss_tokens == float(keep.sum())
    assert result.loss == pytest.approx(float(expected), rel=1e-5)


def adam_steps(adams: list[AdamParams]) -> tuple[PolicyTrainer, torch.nn.Module, list, list]:
    """The trainer's `optim_step(adam)` for each of `adams`, and torch's AdamW by hand with
    the same numbers on a copy of the model fed the same gradients: (trainer, copy, the
    trainer's grad norms, the hand-computed norms)."""
    trainer = make_trainer()
    copy_model = copy.deepcopy(trainer.model)
    hand = torch.optim.AdamW(copy_model.parameters(), lr=1.0)
    norms, hand_norms = [], []
    for step, adam in enumerate(adams):
        batch = datums(explicit_targets=bool(step % 2), seed=step)
        trainer.forward_backward(batch, weighted_nll(1.0))  # sizeable gradients
        for p, q in zip(trainer.model.parameters(), copy_model.parameters(), strict=True):
            q.grad = p.grad.clone()
        hand_norms.append(
            float(torch.nn.utils.get_total_norm([q.grad for q in copy_model.parameters()]))
        )
        if adam.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(copy_model.parameters(), adam.grad_clip_norm)
        for group in hand.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)  # fmt: skip
        hand.step()
        hand.zero_grad()
        norms.append(trainer.optim_step(adam))
    return trainer, copy_model, norms, hand_norms


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)


def test_optim_step_with_adam_params_is_torch_adamw_with_those_numbers():
    adams = [
        AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1),
        AdamParams(learning_rate=3e-3),  # Tinker's defaults; the client sets the lr each step
    ]
    trainer, by_hand, norms, hand_norms = adam_steps(adams)
    assert_same_weights(trainer.model, by_hand)
    assert norms == pytest.approx(hand_norms, rel=1e-5)
    assert trainer.version == 2
    group = trainer.optimizer.param_groups[0]  # no schedule moved the client's numbers
    assert (group["lr"], group["betas"], group["eps"]) == (3e-3, (0.9, 0.95), 1e-12)


def test_grad_clip_norm_zero_does_not_clip():
    # eps = 1 makes the update depend on the gradient's scale, so clipping shows
    unclipped = [AdamParams(learning_rate=1e-2, eps=1.0)] * 2
    trainer, by_hand, norms, hand_norms = adam_steps(unclipped)
    assert min(hand_norms) > 1e-2  # far above the clip norm below
    assert_same_weights(trainer.model, by_hand)
    clipped = [AdamParams(learning_rate=1e-2, eps=1.0, grad_clip_norm=1e-2)] * 2
    clipped_trainer, clipped_by_hand, clipped_norms, clipped_hand_norms = adam_steps(clipped)
    assert_same_weights(clipped_trainer.model, clipped_by_hand)
    # the norm before clipping (the first step's gradients are the same in both)
    assert clipped_norms == pytest.approx(clipped_hand_norms, rel=1e-5)
    assert clipped_norms[0] == pytest.approx(norms[0], rel=1e-5)
    moved = [(p - q).abs().max() for p, q in zip(trainer.model.parameters(), clipped_trainer.model.parameters(), strict=True)]  # fmt: skip
    assert max(moved) > 1e-4


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(tokens=[1, 2], loss_start=0), "loss_start"),
        (dict(tokens=[1, 2], loss_start=3), "loss_start"),
        (dict(tokens=[1, 2, 3], loss_start=1, targets=[4]), "targets"),
        (dict(tokens=[1, 2, 3], loss_start=1, inputs={"weights": [1.0]}), "weights"),
    ],
)
def test_a_datum_that_does_not_add_up_is_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TrainDatum(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"learning_rate": -1.0}, "learning_rate"), ({"beta2": 1.0}, "beta2"), ({"eps": 0.0}, "eps"),
     ({"grad_clip_norm": float("nan")}, "grad_clip_norm")],
)  # fmt: skip
def test_adam_params_out_of_range_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        AdamParams(**{"learning_rate": 1e-3, **kwargs})
