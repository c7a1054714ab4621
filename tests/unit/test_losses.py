"""The loss family against a plain-loop reference: values, gradients, accumulation, metrics.

`reference` below re-derives every loss, correction and aggregation token by
token with the `math` module and returns the loss and its analytic gradient
with respect to the current log-probs; it never calls the code under test.
Finite differences check the reference itself where the objective is an
ordinary function of the log-probs (token ratios and no detached factor that
moves with them: not GSPO's straight-through ratio, CISPO's weight, π_old = π_θ).
"""

import math
import random

import pytest
import torch
from pydantic import ValidationError

from asyncgrpo.base.config.training import LOSS_NAMES
from asyncgrpo.learning.trainer.losses import LOSSES, LossConfig, LossInputs, compute_loss

AGGREGATIONS = ["grpo", "bnpo", "dr_grpo", "dapo"]
CORRECTIONS = [
    "none",
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
    "masked_is",
]


# ---- the reference, in loops ------------------------------------------------------------


def m2_reference(squares: list[float], tau: float) -> list[bool]:
    """Which tokens M2PO keeps: drop the largest squared log-ratio, one at a time, while the
    mean of the rest exceeds τ; the tokens tied with the last one dropped go with it."""
    order = sorted(range(len(squares)), key=lambda j: -squares[j])
    dropped = 0
    while dropped < len(order):
        rest = [squares[j] for j in order[dropped:]]
        if math.fsum(rest) / len(rest) <= tau:
            break
        dropped += 1
    if dropped == 0:
        return [True] * len(squares)
    last = squares[order[dropped - 1]]
    return [value < last for value in squares]


def m2_table(case: dict, tau: float) -> list[list[bool]]:
    """The case's M2 mask over its own loss tokens, δ from π_prox, else π_θ's values."""
    start = case["prox"] if case.get("prox") is not None else case["lp"]
    cells = [(i, t) for i, row in enumerate(case["mask"]) for t, on in enumerate(row) if on]
    squares = [(start[i][t] - case["engine"][i][t]) ** 2 for i, t in cells]
    table = [[False] * len(row) for row in case["mask"]]
    for (i, t), kept in zip(cells, m2_reference(squares, tau), strict=True):
        table[i][t] = kept
    return table


def reference(case: dict, cfg: dict) -> tuple[float, list[list[float]]]:
    lp, mask, adv = case["lp"], case["mask"], case["adv"]
    old = case["old"] if case.get("old") is not None else case["engine"]
    engine, prox = case["engine"], case.get("prox")
    anchor = prox if prox is not None else old
    loss_name = cfg.get("name", "clipped")
    centre = anchor if loss_name == "decoupled_ppo" else old
    cap = cfg.get("correction_cap", 2.0)
    mode = cfg.get("correction", "token_truncate")
    if loss_name == "decoupled_ppo" and mode == "none":
        mode = "raw"
    low, high = 1 - cfg.get("epsilon_low", 0.2), 1 + cfg.get("epsilon_high", 0.28)
    band = cfg.get("masked_is_low", 0.5), cfg.get("masked_is_high", 5.0)
    m2 = cfg.get("trust_region", "clip") == "m2"
    if m2:
        low, high = 0.0, math.inf
        region = case.get("trust_keep") or m2_table(case, cfg.get("m2_threshold", 0.04))
    delta, beta = cfg.get("delta"), cfg.get("beta", 0.0)
    agg = cfg.get("aggregation", "dapo")
    world = case.get("world", 1)
    n_rows, width = len(lp), len(lp[0])
    lengths = [sum(1 for t in range(width) if mask[i][t]) for i in range(n_rows)]
    n_global = case.get("n_global", sum(lengths))
    n_batch = case.get("n_batch", sum(lengths))
    n_seqs = case.get("n_seqs", n_rows)
    max_len = case.get("max_len", width)

    total, grad = 0.0, [[0.0] * width for _ in range(n_rows)]
    for i in range(n_rows):
        valid = [t for t in range(width) if mask[i][t]]
        if not valid:
            continue
        if agg == "dapo":
            scale = world / n_global
        elif agg == "bnpo":
            scale = world / n_batch
        elif agg == "dr_grpo":
            scale = world / (n_seqs * max_len)
        else:
            scale = world / (n_seqs * len(valid))
        seq_log_w = sum(anchor[i][t] - engine[i][t] for t in valid)
        seq_log_r = sum(lp[i][t] - centre[i][t] for t in valid) / len(valid)
        keep = True
        if cfg.get("opsm_delta") is not None:
            mean_kl = sum(engine[i][t] - lp[i][t] for t in valid) / len(valid)
            keep = not (adv[i] < 0 and mean_kl > cfg["opsm_delta"])
        for t in valid:
            log_w = seq_log_w if mode.startswith("sequence") else anchor[i][t] - engine[i][t]
            if mode == "none":
                w = 1.0
            elif mode == "masked_is":
                w = math.exp(log_w) if band[0] <= math.exp(log_w) <= band[1] else 0.0
            elif mode.endswith("truncate"):
                w = math.exp(min(log_w, math.log(cap)))
            elif mode.endswith("mask"):
                w = 1.0 if 1 / cap <= math.exp(log_w) <= cap else 0.0
            else:
                w = math.exp(log_w)
            if cfg.get("ratio_level", "token") == "sequence":
                r = math.exp(seq_log_r)
            else:
                r = math.exp(lp[i][t] - centre[i][t])
            value, slope = 0.0, 0.0  # loss term and its derivative in lp[i][t]
            kept = region[i][t] if m2 else True  # the trust region's mask
            if w * keep * kept > 0:
                clipped = min(max(r, low), high)
                if loss_name == "cispo":
                    value = -clipped * adv[i] * lp[i][t]
                    slope = -clipped * adv[i]
                elif m2:  # no ε-clip: −r̃·A
                    capped = min(r, delta) if (delta is not None and adv[i] < 0) else r
                    value, slope = -capped * adv[i], (-adv[i] * r if capped == r else 0.0)
                else:
                    capped = min(r, delta) if (delta is not None and adv[i] < 0) else r
                    if capped * adv[i] <= clipped * adv[i]:
                        value, passes = -capped * adv[i], capped == r
                    else:
                        value, passes = -clipped * adv[i], low <= r <= high
                    slope = -adv[i] * r if passes else 0.0  # d r / d lp = r (straight-through)
                value, slope = w * value, w * slope
            if beta > 0:
                x = case["ref"][i][t] - lp[i][t]
                coef = 1
                if cfg.get("kl_is_correction"):
                    coef = w * kept * math.exp(lp[i][t] - anchor[i][t])
                value += beta * coef * (math.exp(x) - x - 1)
                slope += beta * coef * (1 - math.exp(x))
            total += scale * value
            grad[i][t] = scale * slope
    return total, grad


# ---- cases --------------------------------------------------------------------------------


def random_case(seed: int, rows: int = 6, width: int = 7, extreme: bool = False) -> dict:
    rng = random.Random(seed)
    lengths = [0, 1] + [rng.randint(1, width) for _ in range(rows - 2)]
    rng.shuffle(lengths)

    def table(fn):
        return [[fn(i, t) for t in range(width)] for i in range(rows)]

    lp = table(lambda i, t: -abs(rng.gauss(1.0, 1.0)) - 0.01)
    old = table(lambda i, t: lp[i][t] + rng.gauss(0, 0.3))
    engine = table(lambda i, t: old[i][t] + rng.gauss(0, 0.6))
    if extreme:  # ±20 in log space between trainer and engine, and in the policy ratio
        for i, t in [(0, 0), (1, 0), (2, 1), (3, 2), (4, 0), (5, 3)]:
            engine[i][t] = old[i][t] + rng.choice([-20.0, 20.0])
        for i, t in [(2, 0), (4, 1)]:
            old[i][t] = lp[i][t] + rng.choice([-20.0, 20.0])
    return {
        "lp": lp,
        "old": old,
        "engine": engine,
        "prox": table(lambda i, t: old[i][t] + rng.gauss(0, 0.2)),
        "ref": table(lambda i, t: lp[i][t] + rng.gauss(0, 0.4)),
        "adv": [rng.choice([0.0, rng.gauss(0, 1.5)]) for _ in range(rows)],
        "mask": [[t < lengths[i] for t in range(width)] for i in range(rows)],
    }


def tensors(case: dict, rows=slice(None), **extra) -> LossInputs:
    def t(key):
        return torch.tensor(case[key][rows], dtype=torch.float64)

    lp = t("lp").requires_grad_()
    counts = {
        "num_global_tokens": case.get("n_global"),
        "num_batch_tokens": case.get("n_batch"),
        "num_global_sequences": case.get("n_seqs"),
        "max_completion_length": case.get("max_len"),
    }
    return LossInputs(
        logprobs=lp,
        engine_logprobs=t("engine"),
        advantages=torch.tensor(case["adv"][rows], dtype=torch.float64),
        mask=torch.tensor(case["mask"][rows]),
        old_logprobs=t("old") if case.get("old") is not None else None,
        ref_logprobs=t("ref"),
        proximal_logprobs=t("prox") if case.get("prox") is not None else None,
        trust_keep=torch.tensor(case["trust_keep"][rows]) if case.get("trust_keep") else None,
        dp_world_size=case.get("world", 1),
        **counts,
        **extra,
    )


def run(case: dict, cfg: dict, rows=slice(None)):
    inputs = tensors(case, rows)
    loss, metrics = compute_loss(inputs, LossConfig(**cfg))
    loss.backward()
    return loss.item(), inputs.logprobs.grad, metrics


def check(case: dict, cfg: dict, rtol: float = 1e-10):
    want_loss, want_grad = reference(case, cfg)
    got_loss, got_grad, metrics = run(case, cfg)
    assert got_loss == pytest.approx(want_loss, rel=rtol, abs=1e-12)
    torch.testing.assert_close(
        got_grad, torch.tensor(want_grad, dtype=torch.float64), rtol=rtol, atol=1e-12
    )
    return metrics


# ---- values and gradients -----------------------------------------------------------------


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_every_combination_matches_the_reference(loss, level, aggregation, correction):
    cfg = dict(name=loss, ratio_level=level, aggregation=aggregation, correction=correction)
    for seed in range(3):
        case = random_case(seed)
        if seed == 1:
            case.update(prox=None, n_global=60, n_batch=50, n_seqs=9, max_len=11)
        if seed == 2:
            case.update(old=None)  # π_old = the engine's log-probs
        metrics = check(case, cfg)
        assert {"clip_ratio", "is_weight_mean", "mismatch_kl", "opsm_drop_ratio"} <= set(metrics)


@pytest.mark.parametrize(
    "options",
    [
        dict(delta=1.5, epsilon_low=0.1, epsilon_high=0.1),
        dict(opsm_delta=0.05),
        dict(beta=0.3),
        dict(beta=0.3, kl_is_correction=True),
        dict(correction_cap=1.3, delta=2.0, opsm_delta=0.0, beta=0.1),
    ],
)
@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_options_match_the_reference(options, loss, level):
    for seed in range(3):
        cfg = dict(name=loss, ratio_level=level, correction=CORRECTIONS[seed + 1], **options)
        check(random_case(10 + seed), cfg)


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_extreme_ratios_stay_finite_and_exact(loss, correction, level):
    case = random_case(7, extreme=True)
    check(case, dict(name=loss, correction=correction, ratio_level=level, delta=3.0, beta=0.1))


def finite_difference(case: dict, cfg: dict, h: float = 1e-6):
    out = []
    for i in range(len(case["lp"])):
        row = []
        for t in range(len(case["lp"][0])):
            values = []
            for sign in (1, -1):
                moved = [list(r) for r in case["lp"]]
                moved[i][t] += sign * h
                values.append(reference({**case, "lp": moved}, cfg)[0])
            row.append((values[0] - values[1]) / (2 * h))
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        dict(aggregation="grpo", correction="sequence_truncate", epsilon_high=0.1),
        dict(name="decoupled_ppo", aggregation="dr_grpo", correction="none", delta=1.4),
        dict(aggregation="bnpo", correction="token_mask", beta=0.2, opsm_delta=0.1),
    ],
)
def test_reference_gradient_agrees_with_finite_differences(cfg):
    case = random_case(21)
    _, analytic = reference(case, cfg)
    torch.testing.assert_close(
        finite_difference(case, cfg),
        torch.tensor(analytic, dtype=torch.float64),
        atol=1e-6,
        rtol=1e-5,
    )


def test_gspo_gradient_is_that_of_the_sequence_objective():
    """GSPO: J = −(1/G) Σ_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log r_it)."""
    case = random_case(5)
    lp = torch.tensor(case["lp"], dtype=torch.float64)
    old = torch.tensor(case["old"], dtype=torch.float64)
    mask = torch.tensor(case["mask"])
    adv = torch.tensor(case["adv"], dtype=torch.float64)

    def objective(x):
        total = 0.0
        for i in range(len(case["lp"])):
            n = int(mask[i].sum())
            if n == 0:
                continue
            s = math.exp(sum(float(x[i, t] - old[i, t]) for t in range(n)) / n)
            total -= min(s * adv[i].item(), min(max(s, 0.8), 1.28) * adv[i].item())
        return total / len(case["lp"])

    fd = torch.zeros_like(lp)
    for i, t in zip(*torch.nonzero(mask, as_tuple=True), strict=True):
        up, down = lp.clone(), lp.clone()
        up[i, t] += 1e-6
        down[i, t] -= 1e-6
        fd[i, t] = (objective(up) - objective(down)) / 2e-6
    cfg = dict(ratio_level="sequence", aggregation="grpo", correction="none")
    _, grad, _ = run(case, cfg)
    torch.testing.assert_close(grad, fd, atol=1e-7, rtol=1e-6)


# ---- exact gradient accumulation and data parallelism -------------------------------------


def split_rows(case: dict, rows: slice) -> dict:
    """The rows of a micro-batch, trimmed to their own padded width like the trainer does."""
    part = {k: (v[rows] if isinstance(v, list) else v) for k, v in case.items()}
    width = max([sum(m) for m in part["mask"]] + [1])
    for key in ("lp", "old", "engine", "prox", "ref", "mask", "trust_keep"):
        if part.get(key) is not None:
            part[key] = [row[:width] for row in part[key]]
    return part


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        dict(name="cispo", ratio_level="sequence", correction="sequence_mask", correction_cap=3.0),
        dict(name="decoupled_ppo", correction="token_mask", beta=0.1, opsm_delta=0.1),
    ],
)
def test_micro_batches_sum_to_the_batch(aggregation, cfg):
    case = random_case(3, rows=8, width=9)
    counts = dict(n_global=sum(map(sum, case["mask"])), n_seqs=8, max_len=9)
    counts["n_batch"] = counts["n_global"]
    case.update(counts)
    cfg = dict(cfg, aggregation=aggregation)
    full_loss, full_grad, _ = run(case, cfg)
    loss_sum, grads = 0.0, []
    for k in range(4):
        part = split_rows(case, slice(2 * k, 2 * k + 2))
        loss, grad, _ = run(part, cfg)
        loss_sum += loss
        grads.append(torch.nn.functional.pad(grad, (0, 9 - grad.shape[1])))
    assert loss_sum == pytest.approx(full_loss, abs=1e-9)
    torch.testing.assert_close(torch.cat(grads), full_grad, atol=1e-9, rtol=0)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_data_parallel_mean_of_rank_gradients(aggregation):
    """Two ranks, two micro-batches each; DDP averages the ranks' accumulated gradients."""
    case = random_case(4, rows=8, width=9)
    tokens = [sum(map(sum, case["mask"][r * 4 : r * 4 + 4])) for r in range(2)]
    cfg = dict(aggregation=aggregation)
    single = dict(case, n_global=sum(tokens), n_batch=sum(tokens), n_seqs=8, max_len=9)
    _, full_grad, _ = run(single, cfg)
    rank_grads = []
    for rank in range(2):
        shared = dict(case, world=2, n_global=sum(tokens), n_batch=sum(tokens), n_seqs=8, max_len=9)
        grads = []
        for k in range(2):
            rows = slice(rank * 4 + 2 * k, rank * 4 + 2 * k + 2)
            _, grad, _ = run(split_rows(shared, rows), cfg)
            grads.append(torch.nn.functional.pad(grad, (0, 9 - grad.shape[1])))
        rank_grads.append(torch.cat(grads))
    averaged = torch.cat(rank_grads) / 2
    torch.testing.assert_close(averaged, full_grad, atol=1e-9, rtol=0)


# ---- on-policy identity, masks, metrics, errors -------------------------------------------


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_on_policy_weights_are_one_and_every_correction_is_a_no_op(loss, level):
    case = random_case(8)
    case["old"] = case["engine"] = case["prox"] = case["lp"]
    base = dict(name=loss, ratio_level=level, opsm_delta=0.0)
    plain_loss, plain_grad, _ = run(case, dict(base, correction="none"))
    for correction in CORRECTIONS[1:]:
        loss_value, grad, metrics = run(case, dict(base, correction=correction))
        assert (
            metrics["is_weight_min"] == metrics["is_weight_max"] == metrics["is_weight_mean"] == 1.0
        )
        assert metrics["masked_fraction"] == 0.0 and metrics["opsm_drop_ratio"] == 0.0
        assert metrics["mismatch_kl"] == 0.0
        assert loss_value == plain_loss
        assert torch.equal(grad, plain_grad)


def test_trainer_loop_form_equals_the_integration_reference():
    """old = current detached, token_truncate, dapo: −Σ min(C, π_θ/π_engine)·min(rA, clip(r)A)/N."""
    case = random_case(9)
    case["old"] = case["lp"]
    metrics = check(case, dict())
    assert metrics["clip_ratio"] == 0.0  # r = 1 everywhere


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_fully_masked_micro_batch_is_a_connected_zero(aggregation, loss):
    lp = torch.full((2, 3), float("nan"), dtype=torch.float64, requires_grad=True)
    inputs = LossInputs(
        logprobs=lp,
        engine_logprobs=torch.full((2, 3), float("nan")),
        advantages=torch.tensor([1.0, -1.0]),
        mask=torch.zeros(2, 3),
        entropy=torch.ones(2, 3),
        num_global_tokens=10.0,
        num_global_sequences=4.0,
    )
    loss_value, metrics = compute_loss(inputs, LossConfig(name=loss, aggregation=aggregation))
    assert loss_value.item() == 0.0 and loss_value.grad_fn is not None
    loss_value.backward()
    assert torch.equal(lp.grad, torch.zeros(2, 3, dtype=torch.float64))
    assert math.isnan(metrics["clip_ratio"]) and math.isnan(metrics["is_weight_mean"])
    assert math.isnan(metrics["entropy"])


def test_padding_garbage_does_not_leak():
    case = random_case(11)
    clean_loss, clean_grad, _ = run(case, dict(beta=0.1, ratio_level="sequence"))
    dirty = {k: v for k, v in case.items()}
    for key in ("lp", "old", "engine", "prox", "ref"):
        dirty[key] = [
            [v if m else float("nan") for v, m in zip(row, mrow)]
            for row, mrow in zip(case[key], case["mask"])
        ]
    loss_value, grad, metrics = run(dirty, dict(beta=0.1, ratio_level="sequence"))
    assert loss_value == clean_loss and torch.equal(grad, clean_grad)
    assert all(not math.isnan(v) for v in metrics.values())


def test_clip_metrics_by_hand():
    # advantages +1, -1, -1, +1 against ratios 1.5, 0.5, 1.5, 0.5 (one token each)
    ratios = [1.5, 0.5, 1.5, 0.5]
    lp = torch.tensor([[math.log(r)] for r in ratios], dtype=torch.float64, requires_grad=True)
    zeros = torch.zeros(4, 1, dtype=torch.float64)
    inputs = LossInputs(
        lp, zeros, torch.tensor([1.0, -1.0, -1.0, 1.0]), torch.ones(4, 1), old_logprobs=zeros
    )
    _, m = compute_loss(inputs, LossConfig(correction="none"))
    assert (m["clip_ratio_high"], m["clip_ratio_low"], m["clip_ratio"]) == (0.25, 0.25, 0.5)
    assert m["clip_ratio_region"] == 1.0
    _, m = compute_loss(inputs, LossConfig(correction="none", delta=1.4))
    assert (m["clip_ratio_delta"], m["clip_ratio"]) == (0.25, 0.75)
    # mismatch: k3 of x = lp − lp_engine = log r per token
    want = sum(r - math.log(r) - 1 for r in ratios) / 4
    assert m["mismatch_kl"] == pytest.approx(want, rel=1e-12)


def test_mask_modes_zero_tokens_outside_the_cap_and_opsm_drops_sequences():
    # token log-weights log(π_old/π_engine): 0, log 3, −log 3, log 1.5 with cap 2
    old = torch.zeros(2, 2, dtype=torch.float64)
    engine = -torch.tensor([[0.0, math.log(3)], [-math.log(3), math.log(1.5)]], dtype=torch.float64)
    lp = old.clone().requires_grad_()
    inputs = LossInputs(lp, engine, torch.tensor([1.0, -1.0]), torch.ones(2, 2), old_logprobs=old)
    _, m = compute_loss(inputs, LossConfig(correction="token_mask"))
    assert (m["masked_fraction"], m["is_weight_min"], m["is_weight_max"]) == (0.5, 0.0, 1.0)
    _, m = compute_loss(inputs, LossConfig(correction="token_truncate"))
    assert m["is_weight_max"] == 2.0 and m["is_weight_min"] == pytest.approx(1 / 3)
    truncated = [1.0, 2.0, 1 / 3, 1.5]  # the weights, log 3 truncated at the cap
    assert m["is_weight_sq_mean"] == pytest.approx(sum(w * w for w in truncated) / 4, rel=1e-12)
    # row 1 has A < 0 and mean log(π_engine/π_θ) = (log 3 − log 1.5)/2 ≈ 0.347
    for delta, dropped in ((0.3, 1.0), (0.4, 0.0)):
        lp.grad = None
        loss, m = compute_loss(inputs, LossConfig(correction="none", opsm_delta=delta))
        loss.backward()
        assert m["opsm_drop_ratio"] == dropped / 2
        assert bool((lp.grad[1] == 0).all()) == bool(dropped)


def test_config_accepts_exactly_the_registered_losses():
    """Config names the losses without importing the trainer: the two lists must agree."""
    assert len(LOSS_NAMES) == len(set(LOSS_NAMES))
    assert set(LOSS_NAMES) == set(LOSSES)
    for name in LOSSES:
        assert LossConfig(name=name).name == name


def test_bad_configs_are_refused_with_the_names():
    with pytest.raises(ValidationError, match="clipped.*decoupled_ppo"):
        LossConfig(name="ppo2")
    with pytest.raises(ValidationError, match="aggregation"):
        LossConfig(aggregation="mean")
    with pytest.raises(ValidationError, match="correction_cap"):
        LossConfig(correction="token_mask", correction_cap=0.5)
    for field, bad in (
        ("correction_cap", 0.0),
        ("correction", "clip"),
        ("ratio_level", "word"),
        ("beta", -0.1),
    ):
        with pytest.raises(ValidationError, match=field):
            LossConfig(**{field: bad})
    lp = torch.zeros(1, 2, requires_grad=True)
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_loss(
            LossInputs(lp, lp.detach(), torch.ones(1), torch.ones(1, 2)), LossConfig(beta=0.1)
        )
