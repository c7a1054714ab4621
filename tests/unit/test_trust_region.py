"""M2PO's trust region and masked importance weights against plain references.

The M2 mask against `m2_reference` (test_losses.py: drop the largest squared log-ratio
one at a time in a Python loop, float64) and hand-worked cases: nothing to mask, a rest
exactly at τ, ties at the cutoff, every token masked. The loss under `trust_region: m2`
against the loop reference for every loss, ratio level and aggregation; the whole-step
mask under gradient accumulation (2 and 3 micro-batches) equal to the full batch, at the
loss and at the trainer (its no-grad pass), with the per-micro-batch mask shown to differ.
`correction: masked_is` against weights worked out by hand. Two gloo ranks:
`tests/integration/test_data_parallel.py`.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from pydantic import ValidationError
from test_losses import (
    AGGREGATIONS,
    check,
    m2_reference,
    m2_table,
    random_case,
    run,
    split_rows,
)

from asyncgrpo.base.config import AdvantageConfig, LossConfig, TrainerConfig, describe
from asyncgrpo.learning.rollout.types import Group, Rollout
from asyncgrpo.learning.trainer import policy_trainer
from asyncgrpo.learning.trainer.corrections import behaviour_weights
from asyncgrpo.learning.trainer.grpo_loss import grpo_datums
from asyncgrpo.learning.trainer.losses import LOSSES, LossInputs, compute_loss
from asyncgrpo.learning.trainer.policy_trainer import PolicyTrainer
from asyncgrpo.learning.trainer.trust_region import m2_cutoff, m2_keep, m2_metrics
from asyncgrpo.testing import build_tiny_llama

# ---- the mask by hand ---------------------------------------------------------------------

# (squared log-ratios, τ, kept, M2 after): worked out in the comments
HAND = [
    # mean 0.02 ≤ 0.04: nothing to mask
    ([0.01, 0.02, 0.03], 0.04, [True, True, True], 0.02),
    # mean 1 > 0.25; without the 4 the rest's mean is 1/4, exactly τ: stop there
    ([0.0, 4.0, 1.0, 0.0, 0.0], 0.25, [True, False, True, True, True], 0.25),
    # mean 0.5 > 0.4; one 1 dropped leaves mean 2/5 = 0.4: the other two 1s are tied with
    # it and go too, leaving three zeros
    ([1.0, 0.0, 1.0, 0.0, 1.0, 0.0], 0.4, [False, True, False, True, False, True], 0.0),
    # 9 is dropped (rest 5/3 > 1), then 4 (rest 1/2 ≤ 1)
    ([1.0, 9.0, 0.0, 4.0], 1.0, [True, False, True, False], 0.5),
    # every token alone exceeds τ: all are masked
    ([2.0, 3.0], 1.0, [False, False], math.nan),
]


@pytest.mark.parametrize("squares, tau, kept, after", HAND)
def test_the_mask_by_hand(squares, tau, kept, after):
    assert m2_reference(squares, tau) == kept  # the loop reference agrees with the hand
    signs = [(-1) ** j for j in range(len(squares))]  # δ of either sign
    log_ratio = torch.tensor(
        [[math.sqrt(v) * s for v, s in zip(squares, signs)]], dtype=torch.float64
    )
    mask = torch.ones_like(log_ratio, dtype=torch.bool)
    keep, metrics = m2_keep(log_ratio, mask, tau)
    assert keep[0].tolist() == kept
    assert metrics["m2_before"] == pytest.approx(sum(squares) / len(squares), rel=1e-12)
    assert metrics["m2_masked_fraction"] == pytest.approx(kept.count(False) / len(kept))
    if math.isnan(after):
        assert math.isnan(metrics["m2_after"])
    else:
        assert metrics["m2_after"] == pytest.approx(after, abs=1e-12)


def test_no_tokens_nothing_masked_and_padding_ignored():
    assert m2_cutoff(torch.zeros(0), 0.04) == math.inf
    assert all(math.isnan(v) for v in m2_metrics(torch.zeros(0), math.inf).values())
    # padding holds garbage (NaN, huge): it neither counts nor is kept
    log_ratio = torch.tensor([[0.1, float("nan"), 50.0], [0.2, 0.3, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, False, False], [True, True, False]])
    keep, metrics = m2_keep(log_ratio, mask, 0.05)  # mean (0.01 + 0.04 + 0.09)/3 ≤ 0.05
    assert keep.tolist() == [[True, False, False], [True, True, False]]
    assert metrics["m2_before"] == pytest.approx((0.01 + 0.04 + 0.09) / 3)
    keep, _ = m2_keep(log_ratio, mask, 0.04)  # > 0.04: the 0.09 goes
    assert keep.tolist() == [[True, False, False], [True, False, False]]


@pytest.mark.parametrize("seed", range(20))
def test_the_mask_equals_the_loop_reference_on_random_values(seed):
    rng = random.Random(seed)
    # repeated values make ties; τ from tiny (most masked) to above the mean (none)
    pool = [rng.expovariate(3.0) for _ in range(8)]
    squares = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
    tau = rng.choice([0.001, 0.05, 0.2, 0.5, 10.0])
    values = torch.tensor(squares, dtype=torch.float64)
    cutoff = m2_cutoff(values, tau)
    assert [v < cutoff for v in squares] == m2_reference(squares, tau)
    shuffled = values[torch.randperm(len(squares), generator=torch.Generator().manual_seed(seed))]
    assert m2_cutoff(shuffled, tau) == cutoff  # the order of the tokens does not matter


# ---- the loss under the M2 trust region ---------------------------------------------------


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_m2_loss_matches_the_reference(loss, level, aggregation):
    for seed, tau in ((30, 0.1), (31, 0.3), (32, 0.05)):
        case = random_case(seed)
        if seed == 31:
            case.update(prox=None)  # δ from π_θ's own values
        cfg = dict(name=loss, ratio_level=level, aggregation=aggregation)
        cfg.update(trust_region="m2", m2_threshold=tau, correction="token_truncate")
        metrics = check(case, cfg)
        kept = [
            k for row, m in zip(m2_table(case, tau), case["mask"]) for k, on in zip(row, m) if on
        ]
        assert 0 < kept.count(False) < len(kept)  # the mask does something
        assert metrics["m2_masked_fraction"] == pytest.approx(kept.count(False) / len(kept))
        assert metrics["clip_ratio"] == 0.0  # no ε-clipping under m2


@pytest.mark.parametrize(
    "options",
    [
        dict(delta=1.5, correction="none"),
        dict(beta=0.3, correction="masked_is"),
        dict(beta=0.3, kl_is_correction=True, opsm_delta=0.05),
    ],
)
def test_m2_with_other_options_matches_the_reference(options):
    for seed in (40, 41):
        check(random_case(seed), dict(trust_region="m2", m2_threshold=0.2, **options))
        check(
            random_case(seed, extreme=True),
            dict(name="decoupled_ppo", trust_region="m2", m2_threshold=0.2, **options),
        )


def test_survivors_are_not_clipped_and_masked_tokens_carry_no_gradient():
    # π_old = the engine's: ratios 1.5 (A = +1) and 0.5 (A = −1), δ² = log(1.5)², log(0.5)²;
    # the third tokens (δ = 3) are masked at τ = 0.5; dapo over 6 tokens
    lp = torch.tensor([[math.log(1.5), math.log(0.5), 3.0]], dtype=torch.float64)
    lp = torch.cat([lp, lp]).requires_grad_()
    inputs = LossInputs(lp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.ones(2, 3))
    loss, m = compute_loss(inputs, LossConfig(correction="none"))
    loss.backward()
    clipped_grad = lp.grad.clone()
    lp.grad = None
    loss, m = compute_loss(
        inputs, LossConfig(correction="none", trust_region="m2", m2_threshold=0.5)
    )
    loss.backward()
    # −A·r/6 per kept token: r = 1.5 at A = +1, r = 0.5 at A = −1
    assert lp.grad[0].tolist()[:2] == pytest.approx([-1.5 / 6, -0.5 / 6])
    assert lp.grad[1].tolist()[:2] == pytest.approx([1.5 / 6, 0.5 / 6])
    assert lp.grad[:, 2].tolist() == [0.0, 0.0]
    assert m["m2_masked_fraction"] == pytest.approx(1 / 3)
    # ε-clipping zeroes the 1.5 at A > 0 and the 0.5 at A < 0 (the tokens that moved most)
    assert clipped_grad[0, 0] == 0.0 and clipped_grad[1, 1] == 0.0


# ---- one mask for the whole step ----------------------------------------------------------


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("cuts", [(0, 4, 8), (0, 3, 6, 8)], ids=["2-micro", "3-micro"])
def test_micro_batches_with_the_step_mask_sum_to_the_batch(aggregation, cuts):
    case = random_case(50, rows=8, width=9)
    tokens = sum(map(sum, case["mask"]))
    case.update(n_global=tokens, n_batch=tokens, n_seqs=8, max_len=9)
    cfg = dict(aggregation=aggregation, trust_region="m2", m2_threshold=0.15, beta=0.1)
    full_loss, full_grad, full_metrics = run(case, cfg)  # the mask over this call: the step's
    assert 0 < full_metrics["m2_masked_fraction"] < 1

    def accumulated(with_step_mask: bool):
        stepped = dict(case, trust_keep=m2_table(case, 0.15)) if with_step_mask else case
        total, grads = 0.0, []
        for start, end in zip(cuts, cuts[1:]):
            loss, grad, _ = run(split_rows(stepped, slice(start, end)), cfg)
            total += loss
            grads.append(torch.nn.functional.pad(grad, (0, 9 - grad.shape[1])))
        return total, torch.cat(grads)

    loss_sum, grad = accumulated(with_step_mask=True)
    assert loss_sum == pytest.approx(full_loss, abs=1e-9)
    torch.testing.assert_close(grad, full_grad, atol=1e-9, rtol=0)
    # each micro-batch's own mask is another objective
    _, own = accumulated(with_step_mask=False)
    assert (own - full_grad).abs().max() > 1e-3


def groups(seed: int = 0) -> list[Group]:
    """4 groups of 3 with unequal lengths and distinct rewards; one sample has an inserted
    (mask 0) token."""
    rng = random.Random(seed)
    out = []
    for g in range(4):
        prompt = [rng.randrange(3, 60) for _ in range(rng.randint(3, 5))]
        rollouts = []
        for k in range(3):
            n = rng.randint(3, 9)
            logprobs = [-rng.uniform(2.5, 6.0) for _ in range(n)]
            mask = None
            if (g, k) == (1, 0):
                mask, logprobs[1] = [1, 0] + [1] * (n - 2), 0.0
            completion = [rng.randrange(3, 60) for _ in range(n)]
            reward = [rng.random()]  # every advantage non-zero
            rollouts.append(
                Rollout(
                    prompt, completion, logprobs, [0] * n, "stop", "", reward, completion_mask=mask
                )
            )
        out.append(Group(g, {}, rollouts))
    return out


def m2_trainer(budget: int, tau: float = 0.5) -> PolicyTrainer:
    return PolicyTrainer(
        build_tiny_llama(64, seed=0).double(),
        TrainerConfig(bf16_autocast=False, micro_batch_tokens=budget),
        LossConfig(trust_region="m2", m2_threshold=tau),
        AdvantageConfig(),
        max_steps=10,
    )


def accumulated(trainer: PolicyTrainer):
    batch = trainer.prepare(groups())
    totals = trainer.accumulate(batch)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    return batch, totals, grads


def test_the_trainer_masks_the_whole_step_under_accumulation(monkeypatch):
    """One micro-batch (the loss finds the mask) against 2 and 3 (the trainer's no-grad pass
    finds it first); the M2 metrics against the loop reference on `forward`'s log-probs."""
    whole = m2_trainer(4096)
    batch, totals, grads = accumulated(whole)
    assert len(whole.plan(batch)) == 1
    datums = grpo_datums(batch)
    squares = []
    for datum, logprobs in zip(datums, whole.forward(datums), strict=True):
        engine, mask = datum.inputs["engine_logprobs"], datum.inputs["mask"]
        squares += [(float(x) - float(e)) ** 2 for x, e, m in zip(logprobs, engine, mask) if m]
    kept = m2_reference(squares, 0.5)
    metrics = totals.means()
    assert metrics["m2_masked_fraction"] == pytest.approx(kept.count(False) / len(kept))
    assert 0 < metrics["m2_masked_fraction"] < 1
    assert metrics["m2_before"] == pytest.approx(sum(squares) / len(squares), rel=1e-9)
    kept_values = [v for v, k in zip(squares, kept) if k]
    assert metrics["m2_after"] == pytest.approx(sum(kept_values) / len(kept_values), rel=1e-9)
    for budget, runs in ((64, 2), (56, 3)):
        split = m2_trainer(budget)
        split_batch, split_totals, split_grads = accumulated(split)
        assert len(split.plan(split_batch)) == runs
        assert split_totals.loss == pytest.approx(totals.loss, rel=1e-6)
        for key in ("m2_before", "m2_after", "m2_masked_fraction"):
            assert split_totals.means()[key] == pytest.approx(metrics[key], rel=1e-9), key
        for name, grad in grads.items():
            torch.testing.assert_close(split_grads[name], grad, atol=1e-7, rtol=1e-5)
    # without the trainer's pass, each micro-batch masks by its own M2: another gradient
    monkeypatch.setattr(policy_trainer, "step_mask", lambda trainer, batch, datums: (datums, {}))
    _, _, own = accumulated(m2_trainer(56))
    assert max(float((own[n] - g).abs().max()) for n, g in grads.items()) > 1e-3


# ---- masked importance weights ------------------------------------------------------------


def test_masked_is_weights_by_hand():
    # ρ = 0.4, 0.5, 1, 3, 5, 6 with the band [0.5, 5]: bounds inclusive, ρ kept inside
    rho = [0.4, 0.5, 1.0, 3.0, 5.0, 6.0]
    log_ratio = torch.tensor([[math.log(r) for r in rho]], dtype=torch.float64)
    mask = torch.ones_like(log_ratio, dtype=torch.bool)
    weights = behaviour_weights(log_ratio, mask, "masked_is", 2.0, (0.5, 5.0))
    assert weights[0].tolist() == pytest.approx([0.0, 0.5, 1.0, 3.0, 5.0, 0.0], rel=1e-12)
    # token_mask at C = 2: the symmetric band [1/2, 2], weight 1 inside
    token_mask = behaviour_weights(log_ratio, mask, "token_mask", 2.0)
    assert token_mask[0].tolist() == [0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    # another band: [0.45, 3.5]
    narrow = behaviour_weights(log_ratio, mask, "masked_is", 2.0, (0.45, 3.5))
    assert narrow[0].tolist() == pytest.approx([0.0, 0.5, 1.0, 3.0, 0.0, 0.0], rel=1e-12)


def test_masked_is_gradient_by_hand():
    # π_old = π_θ's values, π_engine = π_old − log ρ: each token's gradient is −A·w/N
    rho = [0.3, 0.8, 4.0, 7.0]
    lp = torch.full((1, 4), -1.0, dtype=torch.float64, requires_grad=True)
    engine = (lp.detach() - torch.tensor([[math.log(r) for r in rho]])).double()
    inputs = LossInputs(lp, engine, torch.tensor([2.0]), torch.ones(1, 4), old_logprobs=lp.detach())
    loss, m = compute_loss(inputs, LossConfig(correction="masked_is"))
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([0.0, -2 * 0.8 / 4, -2 * 4.0 / 4, 0.0])
    assert m["masked_fraction"] == 0.5 and m["is_weight_max"] == pytest.approx(4.0)


# ---- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, bad",
    [
        ("m2_threshold", 0.0),
        ("m2_threshold", -1.0),
        ("trust_region", "kl"),
        ("masked_is_low", 0.0),
        ("masked_is_low", 1.0),
        ("masked_is_high", 1.0),
        ("masked_is_high", 0.5),
    ],
)
def test_bad_trust_region_and_band_are_refused_with_the_field(field, bad):
    with pytest.raises(ValidationError, match=field):
        LossConfig(**{field: bad})


def test_defaults_and_help_config():
    cfg = LossConfig()
    assert (cfg.trust_region, cfg.m2_threshold) == ("clip", 0.04)
    assert (cfg.masked_is_low, cfg.masked_is_high) == (0.5, 5.0)
    lines = "\n".join(describe())
    for line in (
        "loss.trust_region = 'clip'  # ",
        "loss.m2_threshold = 0.04  # ",
        "loss.masked_is_low = 0.5  # ",
        "loss.masked_is_high = 5.0  # ",
    ):
        assert line in lines
    assert "masked_is" in lines.split("loss.correction = ")[1].split("\n")[0]
