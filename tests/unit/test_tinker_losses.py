"""The Tinker losses against plain-Python loops: value, gradient w.r.t. the learner's
log-probs, and clip fraction, token by token (asyncgrpo.tinker.losses)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from asyncgrpo.tinker import wire
from asyncgrpo.tinker.errors import TinkerUserError
from asyncgrpo.tinker.losses import LOSSES, MetricTotals, make_loss

LENGTHS = (5, 3, 4)  # ragged rows: the micro-batch pads them to 5
# log-ratio tlp - slp per token: below 0.8 (-0.5), inside (±0.05), above 1.2 (+0.4)
DELTAS = (-0.5, 0.05, 0.4, -0.05, -0.5, 0.4)


def make_rows(seed: int, zero_advantage_every: int = 4) -> list[dict[str, list[float]]]:
    """Per datum, per-token lists: tlp, slp, advantages (both signs, some 0), weights
    (both signs), sequence_ratio_mask (partial)."""
    rng = random.Random(seed)
    rows, k = [], 0
    for length in LENGTHS:
        row = {"tlp": [], "slp": [], "adv": [], "w": [], "seq": []}
        for t in range(length):
            slp = -rng.uniform(0.2, 3.0)
            row["slp"].append(slp)
            row["tlp"].append(slp + DELTAS[k % len(DELTAS)])
            adv = rng.choice([-1.0, 1.0]) * rng.uniform(0.3, 2.0)
            row["adv"].append(0.0 if k % zero_advantage_every == 3 else adv)
            row["w"].append(rng.uniform(-1.0, 2.0))
            row["seq"].append(1.0 if t % 3 != 2 else 0.0)
            k += 1
        rows.append(row)
    return rows


def padded(rows, key: str) -> torch.Tensor:
    width = max(LENGTHS)
    return torch.tensor([r[key] + [0.0] * (width - len(r[key])) for r in rows])


def run(name: str, rows, config=None):
    """(loss, metrics, gradient rows) of the torch loss on the padded micro-batch."""
    logprobs = padded(rows, "tlp").requires_grad_(True)
    mask = padded([{"m": [1.0] * len(r["tlp"])} for r in rows], "m")
    inputs = {
        "weights": padded(rows, "w"),
        "logprobs": padded(rows, "slp"),
        "advantages": padded(rows, "adv"),
        "sequence_ratio_mask": padded(rows, "seq"),
    }
    loss_fn = make_loss(name, config)
    loss, metrics = loss_fn(logprobs, mask, {k: inputs[k] for k in loss_fn.inputs})
    loss.backward()
    grads = [logprobs.grad[i, : len(r["tlp"])].tolist() for i, r in enumerate(rows)]
    assert logprobs.grad[1, 3:].abs().sum() == 0  # padding carries no gradient
    return float(loss.detach()), metrics.result(), grads


def clip(x: float, low: float, high: float) -> float:
    return min(max(x, low), high)


def hand_clipped(ratio: float, adv: float, low: float, high: float) -> tuple[float, float, bool]:
    """PPO's per-token (objective, d objective / d tlp, clipped?) given the ratio's value."""
    unclipped, clipped = ratio * adv, clip(ratio, low, high) * adv
    grad = ratio * adv if unclipped <= clipped else 0.0
    return min(unclipped, clipped), grad, not low <= ratio <= high


def hand_loss(name: str, rows, low=0.8, high=1.2, beta=0.0):
    """(loss, gradient rows, clipped tokens, loss-carrying tokens) by plain loops."""
    loss, grads, clipped_count, active_count = 0.0, [], 0, 0
    for r in rows:
        row_grads = []
        seq_terms = [r["tlp"][t] - r["slp"][t] for t in range(len(r["tlp"])) if r["seq"][t]]
        seq_ratio = math.exp(sum(seq_terms) / len(seq_terms)) if seq_terms else 1.0
        for tlp, slp, adv, w in zip(r["tlp"], r["slp"], r["adv"], r["w"], strict=True):
            ratio = math.exp(tlp - slp)
            was_clipped = False
            if name == "cross_entropy":
                objective, grad = tlp * w, w
            elif name == "dro":
                objective = tlp * adv - 0.5 * beta * (tlp - slp) ** 2
                grad = adv - beta * (tlp - slp)
            elif adv == 0:
                objective, grad = 0.0, 0.0
            elif name == "importance_sampling":
                objective, grad = ratio * adv, ratio * adv
            elif name == "cispo":
                coefficient = clip(ratio, low, high)
                objective, grad = coefficient * tlp * adv, coefficient * adv
                was_clipped = coefficient != ratio
            else:  # ppo, gspo
                value = seq_ratio if name == "gspo" else ratio
                objective, grad, was_clipped = hand_clipped(value, adv, low, high)
            if adv != 0:
                active_count += 1
                clipped_count += was_clipped
            loss -= objective
            row_grads.append(-grad)
        grads.append(row_grads)
    return loss, grads, clipped_count, active_count


CASES = [
    ("cross_entropy", None, {}),
    ("importance_sampling", None, {}),
    ("ppo", None, {}),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, {"low": 0.9, "high": 1.1}),
    ("cispo", None, {"low": 0.0, "high": 4.0}),
    ("cispo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, {}),
    ("dro", {"beta": 0.3}, {"beta": 0.3}),
    ("gspo", None, {}),
    (
        "gspo",
        {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05},
        {"low": 0.95, "high": 1.05},
    ),
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("name", "config", "hand_config"), CASES)
def test_loss_and_gradient_match_a_plain_loop(name, config, hand_config, seed):
    rows = make_rows(seed)
    loss, metrics, grads = run(name, rows, config)
    want_loss, want_grads, clipped, active = hand_loss(name, rows, **hand_config)
    assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-5)
    assert metrics["loss:sum"] == pytest.approx(want_loss, rel=1e-5, abs=1e-5)
    for got, want in zip(grads, want_grads, strict=True):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    if name in ("ppo", "cispo", "gspo"):
        assert metrics["clip_fraction:mean"] == pytest.approx(clipped / active)
    else:
        assert set(metrics) == {"loss:sum"}


def test_the_cases_exercise_both_clip_sides_and_negative_weights():
    """The inputs above are not vacuous: PPO clips below and above with gradients zeroed
    on both sides, cross_entropy sees negative weights, gspo's mask is partial."""
    rows = make_rows(0)
    ratios = [
        (math.exp(t - s), a)
        for r in rows
        for t, s, a in zip(r["tlp"], r["slp"], r["adv"], strict=True)
        if a
    ]
    assert any(r < 0.8 and a < 0 for r, a in ratios)  # clipped below, gradient 0
    assert any(r > 1.2 and a > 0 for r, a in ratios)  # clipped above, gradient 0
    assert any(r < 0.8 and a > 0 for r, a in ratios)  # outside, unclipped branch kept
    assert any(w < 0 for r in rows for w in r["w"])
    assert any(0 < sum(r["seq"]) < len(r["seq"]) for r in rows)
    _, _, grads = run("ppo", rows)
    flat = [g for row in grads for g in row]
    assert sum(g == 0 for g in flat) > sum(a == 0 for r in rows for a in r["adv"])


def test_gspo_ratio_ignores_tokens_outside_the_sequence_mask():
    rows = make_rows(3)
    _, _, base = run("gspo", rows)
    for r in rows:  # move only the masked-out tokens' sampler log-probs
        r["slp"] = [s if m else s - 5.0 for s, m in zip(r["slp"], r["seq"], strict=True)]
        r["adv"] = [a if m else 0.0 for a, m in zip(r["adv"], r["seq"], strict=True)]
    _, _, moved = run("gspo", rows)
    for got, want, r in zip(moved, base, rows, strict=True):
        for g, w, m in zip(got, want, r["seq"], strict=True):
            if m:
                assert g == pytest.approx(w, rel=1e-6)


def test_a_zero_advantage_masks_an_extreme_sampler_logprob():
    rows = make_rows(0)
    rows[0]["slp"][3] = -500.0  # exp(tlp + 500) overflows float32
    rows[0]["adv"][3] = 0.0
    rows[0]["seq"][3] = 0.0  # (inside gspo's sequence mask it would count, as defined)
    for name in ("importance_sampling", "ppo", "cispo", "gspo"):
        loss, _, grads = run(name, rows)
        assert math.isfinite(loss)
        assert all(math.isfinite(g) for row in grads for g in row)


def test_clip_fraction_merges_as_counts_across_micro_batches():
    totals = MetricTotals()
    first, second = MetricTotals(), MetricTotals()
    first.add_mean("clip_fraction", 1.0, 4.0)
    first.add_sum("loss", 2.0)
    second.add_mean("clip_fraction", 3.0, 4.0)
    second.add_sum("loss", -0.5)
    totals.merge(first)
    totals.merge(second)
    assert totals.result() == {"loss:sum": 1.5, "clip_fraction:mean": 0.5}


@pytest.mark.parametrize(
    ("name", "config", "field", "words"),
    [
        ("stable_reinforce", None, "loss_fn", ["importance_sampling", "ppo"]),
        ("dpo", None, "loss_fn", ["cross_entropy", "gspo"]),
        ("ppo", {"clip_ratio": 0.2}, "loss_fn_config.clip_ratio", ["clip_low_threshold"]),
        ("importance_sampling", {"beta": 1.0}, "loss_fn_config.beta", ["no config"]),
        ("dro", None, "loss_fn_config.beta", ["needs"]),
        ("dro", {"beta": -1.0}, "loss_fn_config.beta", ["negative"]),
        ("ppo", {"clip_low_threshold": "x"}, "loss_fn_config.clip_low_threshold", ["number"]),
        ("ppo", {"clip_high_threshold": float("nan")}, "clip_high_threshold", ["finite"]),
        ("cispo", {"clip_low_threshold": 5.0}, "loss_fn_config", ["clip_high_threshold"]),
    ],
)
def test_bad_loss_or_config_is_a_user_error_naming_the_field(name, config, field, words):
    with pytest.raises(TinkerUserError) as caught:
        make_loss(name, config)
    assert caught.value.field.endswith(field)
    for word in words:
        assert word in str(caught.value)


def test_losses_read_the_inputs_and_config_keys_the_wire_checks():
    assert set(LOSSES) == set(wire.REQUIRED_INPUTS)
    for name, spec in LOSSES.items():
        assert ("target_tokens", *spec.inputs) == wire.REQUIRED_INPUTS[name]
        assert tuple(spec.defaults) == wire.LOSS_CONFIG_KEYS[name]
