"""Group advantages: numbers worked out by hand, several weighted reward functions,
None/NaN rewards, degenerate groups, batch scaling, and a loop reference on random data."""

import math
import random

import numpy as np
import pytest
from pydantic import ValidationError

from asyncgrpo.learning.rollout.advantages import AdvantageConfig, compute_advantages

EPS = 1e-4


def close(got, want):
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want, rtol=0, atol=1e-12)


def test_two_groups_by_hand():
    # group 7: [1, 2, 6]: mean 3, deviations -2 -1 3, sum of squares 14, unbiased var 7
    # group 9: [1, 0]: mean 0.5, deviations 0.5 -0.5, unbiased var 0.5
    result = compute_advantages(
        [[1.0], [1.0], [2.0], [0.0], [6.0]], [7, 9, 7, 9, 7], AdvantageConfig()
    )
    s7, s9 = math.sqrt(7) + EPS, math.sqrt(0.5) + EPS
    close(result.advantages, [-2 / s7, 0.5 / s9, -1 / s7, -0.5 / s9, 3 / s7])
    close(result.rewards, [1, 1, 2, 0, 6])
    assert result.group_ids == [7, 9]
    assert result.degenerate.tolist() == [False, False]
    assert result.mask.all()
    assert result.advantages.dtype == np.float64


def test_weighted_functions_with_missing_rewards():
    # weights (2, 0.5): [1, None] -> 2; [0, 2] -> 1; [None, None] -> masked; [1, 2] -> 3
    # valid rewards 2 1 3: mean 2, deviations 0 -1 1, unbiased var 1
    rows = [[1.0, None], [0.0, 2.0], [None, None], [1.0, 2.0]]
    result = compute_advantages(rows, [0, 0, 0, 0], AdvantageConfig(), weights=[2.0, 0.5])
    close(result.advantages, [0.0, -1 / (1 + EPS), 0.0, 1 / (1 + EPS)])
    close(result.rewards, [2.0, 1.0, np.nan, 3.0])
    assert result.mask.tolist() == [True, True, False, True]
    assert result.degenerate.tolist() == [False]


def test_nan_is_the_same_as_none():
    with_none = compute_advantages(
        [[1.0, None], [0.0, 3.0], [2.0, 1.0]], [0, 0, 0], AdvantageConfig()
    )
    with_nan = compute_advantages(
        [[1.0, math.nan], [0.0, 3.0], [2.0, 1.0]], [0, 0, 0], AdvantageConfig()
    )
    close(with_nan.advantages, with_none.advantages)
    close(with_nan.rewards, [1.0, 3.0, 3.0])


def test_singleton_and_zero_variance_groups_are_degenerate_with_zero_advantage():
    rows = [[5.0], [None], [0.3], [0.3], [0.3], [4.0], [1.0], [None]]
    ids = [1, 1, 2, 2, 2, 3, 3, 4]
    result = compute_advantages(rows, ids, AdvantageConfig())
    # group 1: one valid sample left (not the raw reward 5); group 2: all 0.3; group 4: none
    assert result.degenerate.tolist() == [True, True, False, True]
    s = math.sqrt(4.5) + EPS  # group 3: [4, 1]: mean 2.5, deviations 1.5 -1.5, var 4.5
    close(result.advantages, [0, 0, 0, 0, 0, 1.5 / s, -1.5 / s, 0])
    assert result.mask.tolist() == [True, False, True, True, True, True, True, False]
    # how the orchestrator asks about one group
    solo = compute_advantages([[0.3], [0.3], [0.3]], [0, 0, 0], AdvantageConfig())
    assert bool(solo.degenerate[0]) is True


def test_batch_and_no_scaling():
    rows, ids = [[1.0], [3.0], [10.0], [14.0]], [0, 0, 1, 1]
    # batch: mean 7, deviations -6 -4 3 7, sum of squares 110, unbiased var 110/3
    s = math.sqrt(110 / 3) + EPS
    batch = compute_advantages(rows, ids, AdvantageConfig(scale_rewards="batch"))
    close(batch.advantages, [-1 / s, 1 / s, -2 / s, 2 / s])  # centred on the group means 2, 12
    close(
        compute_advantages(rows, ids, AdvantageConfig(scale_rewards="none")).advantages,
        [-1, 1, -2, 2],
    )


def test_normalize_then_sum():
    # f1 [0, 1, 2]: mean 1, var 1 -> [-1, 0, 1] / (1 + eps)
    # f2 [2, None, 0]: over its two samples mean 1, var 2 -> [1, -, -1] / (sqrt 2 + eps)
    rows = [[0.0, 2.0], [1.0, None], [2.0, 0.0]]
    cfg = AdvantageConfig(combine="normalize_then_sum")
    result = compute_advantages(rows, [0, 0, 0], cfg, weights=[1.0, 3.0])
    a1, a2 = 1 / (1 + EPS), 1 / (math.sqrt(2) + EPS)
    close(result.advantages, [-a1 + 3 * a2, 0.0, a1 - 3 * a2])
    close(result.rewards, [6.0, 1.0, 2.0])
    # a function that is constant within the group contributes nothing; the group stays alive
    flat = compute_advantages([[0.0, 4.0], [1.0, 4.0], [2.0, 4.0]], [0, 0, 0], cfg)
    close(flat.advantages, [-a1, 0.0, a1])
    assert flat.degenerate.tolist() == [False]
    both = compute_advantages([[1.0, 4.0], [1.0, 4.0]], [0, 0], cfg)
    assert both.degenerate.tolist() == [True]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="different lengths"):
        compute_advantages([[1.0], [1.0, 2.0]], [0, 0], AdvantageConfig())
    with pytest.raises(ValueError, match="weights"):
        compute_advantages([[1.0], [2.0]], [0, 0], AdvantageConfig(), weights=[1.0, 1.0])
    with pytest.raises(ValidationError, match="scale"):
        AdvantageConfig(scale_rewards="rank")
    with pytest.raises(ValidationError, match="combine"):
        AdvantageConfig(combine="mean")
    empty = compute_advantages([], [], AdvantageConfig())
    assert empty.advantages.shape == (0,) and empty.degenerate.shape == (0,)


def reference(rows, ids, weights, scale):
    """Sum then normalise, in plain loops."""
    combined = []
    for row in rows:
        parts = [w * r for w, r in zip(weights, row) if r is not None and not math.isnan(r)]
        combined.append(sum(parts) if parts else None)
    valid_all = [r for r in combined if r is not None]
    batch_mean = sum(valid_all) / len(valid_all)
    batch_std = math.sqrt(sum((r - batch_mean) ** 2 for r in valid_all) / (len(valid_all) - 1))
    out = []
    for i, r in enumerate(combined):
        group = [
            combined[j] for j in range(len(rows)) if ids[j] == ids[i] and combined[j] is not None
        ]
        if r is None or len(group) < 2 or len(set(group)) == 1:
            out.append(0.0)
            continue
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        if scale == "group":
            out.append((r - mean) / (std + EPS))
        elif scale == "batch":
            out.append((r - mean) / (batch_std + EPS))
        else:
            out.append(r - mean)
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_random_batches_match_a_loop_reference(scale):
    rng = random.Random(scale)
    for _ in range(20):
        n = rng.randint(2, 24)
        ids = [rng.randint(0, 5) * 11 for _ in range(n)]
        rows = [
            [
                rng.choice([None, math.nan, float(rng.randint(0, 2)), rng.gauss(0, 1)])
                for _ in range(3)
            ]
            for _ in range(n)
        ]
        rows[0] = [1.0, 2.0, 3.0]
        rows[1] = [0.0, None, -1.0]
        weights = [rng.uniform(0.1, 2) for _ in range(3)]
        got = compute_advantages(rows, ids, AdvantageConfig(scale_rewards=scale), weights)
        close(got.advantages, reference(rows, ids, weights, scale))
