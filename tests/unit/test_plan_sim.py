"""The planner's simulation against cases worked out by hand, and its invariants."""

from __future__ import annotations

import pytest

from asyncgrpo.plan import Costs, Deployment, Lengths, TraceRecorder, predict

L, P, G, BG = 100, 10, 8, 4  # completion and prompt tokens, group size, groups per batch
B = G * BG  # sequences per batch


def costs(**kw) -> Costs:
    base = dict(
        decode_base_s=0.02,
        decode_per_seq_s=0.001,
        prefill_per_token_s=1e-4,
        train_base_s=0.3,
        train_per_token_s=0.001,
        sync_transfer_s=0.2,
        pause_s=0.05,
    )
    return Costs(**{**base, **kw})


def hand_generate_s(c: Costs) -> float:
    """One batch on one engine, all B sequences admitted at once: a plain loop over steps."""
    t = B * P * c.prefill_per_token_s
    for i in range(L):
        context = B * (P + i)
        t += c.decode_base_s + c.decode_per_seq_s * B + c.decode_per_ctx_s * context
    return t


def hand_train_s(c: Costs) -> float:
    return c.train_base_s + B * (P + L) * c.train_per_token_s


def layout(**kw) -> Deployment:
    return Deployment(batch_groups=BG, num_generations=G, **kw)


@pytest.mark.parametrize("per_ctx", [0.0, 2e-6])
@pytest.mark.parametrize("train_per_token", [0.0005, 0.003])  # engine-bound, trainer-bound
def test_closed_form_sync_and_async_steps(per_ctx, train_per_token):
    c = costs(decode_per_ctx_s=per_ctx, train_per_token_s=train_per_token)
    gen, train, sync = hand_generate_s(c), hand_train_s(c), c.sync_transfer_s + c.pause_s
    lengths = Lengths.constant(L, P)
    synchronous = predict(layout(max_staleness=0), c, lengths)
    assert synchronous.step_s == pytest.approx(gen + train + sync, rel=0.01)
    asynchronous = predict(layout(max_staleness=1, max_ahead_batches=1.0), c, lengths)
    assert asynchronous.step_s == pytest.approx(max(gen + c.pause_s, train + sync), rel=0.01)
    assert synchronous.staleness == {0: 32 * BG} and asynchronous.staleness == {1: 32 * BG}


def test_sync_trainer_idles_while_the_engine_generates():
    c = costs()
    gen, train, sync = hand_generate_s(c), hand_train_s(c), c.sync_transfer_s + c.pause_s
    p = predict(layout(max_staleness=0), c, Lengths.constant(L, P))
    assert p.trainer_idle == pytest.approx(gen / (gen + train + sync), rel=0.01)
    assert p.engine_idle == pytest.approx((train + sync) / (gen + train + sync), rel=0.01)


def test_two_replicas_split_a_batch_by_least_outstanding_work():
    c = costs(train_per_token_s=1e-5)  # engine-bound: the split shows in the step
    one = predict(layout(max_staleness=0), c, Lengths.constant(L, P))
    two = predict(layout(max_staleness=0, engines=2), c, Lengths.constant(L, P))
    # each replica runs half the batch: B/2 sequences per decode step
    half = B // 2 * P * c.prefill_per_token_s + L * (c.decode_base_s + c.decode_per_seq_s * B / 2)
    assert two.step_s == pytest.approx(
        half + hand_train_s(c) + c.sync_transfer_s + c.pause_s, rel=0.01
    )
    assert two.step_s < one.step_s


TAILED = Lengths.lognormal(median=60, sigma=0.9, max_tokens=400, prompt_tokens=20)
REGIMES = {
    "engine-bound": costs(train_per_token_s=2e-5),
    "balanced": costs(train_per_token_s=4e-4),
    "trainer-bound": costs(train_per_token_s=2e-3),
}


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("ahead", [1.0, None])
@pytest.mark.parametrize("seed", [0, 1])
def test_more_staleness_never_lowers_throughput(regime, ahead, seed):
    rates = [
        predict(
            layout(max_staleness=s, max_ahead_batches=ahead), REGIMES[regime], TAILED, seed=seed
        ).samples_per_s
        for s in range(4)
    ]
    assert all(b >= a * (1 - 1e-9) for a, b in zip(rates, rates[1:])), rates
    assert rates[1] > rates[0]  # some overlap always pays here


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
@pytest.mark.parametrize("engines", [1, 3])
@pytest.mark.parametrize(("staleness", "sync_every"), [(0, 1), (1, 1), (2, 2), (3, 1)])
@pytest.mark.parametrize("ahead", [1.0, 1.5, None])
def test_throttle_bound_holds_in_every_trace(mode, engines, staleness, sync_every, ahead):
    lay = layout(
        engines=engines,
        max_staleness=staleness,
        weight_sync_steps=sync_every,
        sync_mode=mode,
        max_ahead_batches=ahead,
        max_num_seqs=24,  # below a batch: requests wait for slots
    )
    recorder = TraceRecorder()
    p = predict(lay, REGIMES["balanced"], TAILED, seed=3, steps=20, warmup=4, recorder=recorder)
    assert len(recorder.points) > 100
    assert max(held for _, held, _ in recorder.points) >= 1
    assert max(p.staleness) <= staleness  # drop-at-consume keeps every trained group in bound


def test_the_recorder_fails_a_trace_over_the_bound():
    with pytest.raises(AssertionError, match="5 groups queued or in flight > 4"):
        TraceRecorder().check(1.0, held=5, budget=8, max_ahead=4)


def test_abort_costs_a_prefill_of_the_running_contexts():
    c = costs(prefill_per_token_s=2e-3, train_per_token_s=2e-5)
    lengths = Lengths.constant(L, P)
    keep = predict(layout(max_staleness=1, max_ahead_batches=None), c, lengths)
    abort = predict(layout(max_staleness=1, max_ahead_batches=None, sync_mode="abort"), c, lengths)
    assert abort.samples_per_s < keep.samples_per_s


def test_same_seed_same_prediction_other_seed_other_draws():
    lay = layout(max_staleness=2, max_ahead_batches=None, engines=2)
    first = predict(lay, REGIMES["balanced"], TAILED, seed=7)
    assert predict(lay, REGIMES["balanced"], TAILED, seed=7) == first
    assert predict(lay, REGIMES["balanced"], TAILED, seed=8).step_s != first.step_s


def test_per_step_work_outside_train_and_sync_counts_as_trainer_idle():
    """As the run's timeline counts it (`metrics/timeline.py`: busy = trainer + weight_sync)."""
    c = costs(train_per_token_s=3e-3, step_overhead_s=1.0)  # trainer-bound: it never waits
    train, sync = hand_train_s(c), c.sync_transfer_s + c.pause_s
    p = predict(layout(max_staleness=1, max_ahead_batches=1.0), c, Lengths.constant(L, P))
    assert p.step_s == pytest.approx(1.0 + train + sync, rel=0.01)
    assert p.trainer_idle == pytest.approx(1.0 / (1.0 + train + sync), rel=0.01)


@pytest.mark.parametrize("per_ctx", [0.0, 2e-6])
def test_one_shared_core_runs_generation_and_training_one_after_the_other(per_ctx):
    """Trainer-bound, engine and trainer one thread each: on one core the overlap buys
    nothing (both run at half speed while both compute), so an async step costs what a
    sync step does; on two cores the roles do not slow each other at all."""
    c = costs(decode_per_ctx_s=per_ctx, train_per_token_s=0.003)
    gen, train, sync = hand_generate_s(c), hand_train_s(c), c.sync_transfer_s + c.pause_s
    assert gen < train
    lengths = Lengths.constant(L, P)
    one_core = predict(layout(max_staleness=1, shared_cores=1), c, lengths)
    assert one_core.step_s == pytest.approx(gen + train + sync, rel=0.01)
    sync_one_core = predict(layout(max_staleness=0, shared_cores=1), c, lengths)
    assert sync_one_core.step_s == pytest.approx(gen + train + sync, rel=0.01)
    two_cores = predict(layout(max_staleness=1, shared_cores=2), c, lengths)
    own_devices = predict(layout(max_staleness=1), c, lengths)
    assert two_cores.step_s == pytest.approx(own_devices.step_s, rel=1e-9)
    assert two_cores.step_s == pytest.approx(train + sync, rel=0.01)


@pytest.mark.parametrize("regime", ["engine-bound", "balanced", "trainer-bound"])
@pytest.mark.parametrize("engines", [1, 2])
def test_fewer_shared_cores_never_raise_throughput(regime, engines):
    rates = [
        predict(
            layout(engines=engines, max_staleness=1, shared_cores=cores),
            REGIMES[regime],
            TAILED,
            seed=1,
            steps=16,
            warmup=4,
        ).samples_per_s
        for cores in (1, 1.5, 2, 3, 8)
    ]
    assert rates == sorted(rates)
    assert rates[-1] == pytest.approx(
        predict(
            layout(engines=engines, max_staleness=1),
            REGIMES[regime],
            TAILED,
            seed=1,
            steps=16,
            warmup=4,
        ).samples_per_s,  # fmt: skip
        rel=1e-9,
    )


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
@pytest.mark.parametrize("engines", [1, 3])
def test_throttle_bound_holds_on_a_shared_host(mode, engines):
    lay = layout(engines=engines, max_staleness=2, sync_mode=mode, shared_cores=2)
    recorder = TraceRecorder()
    p = predict(lay, REGIMES["balanced"], TAILED, seed=5, steps=16, warmup=4, recorder=recorder)
    assert len(recorder.points) > 100
    assert max(p.staleness) <= 2
