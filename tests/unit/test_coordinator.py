"""Staleness rules and the rollout buffer: bounds hold, quota is released, accounting closes."""

import random
import threading
from dataclasses import dataclass

import pytest

from asyncgrpo.base.staleness import admission_budget, is_too_stale, may_admit
from asyncgrpo.learning.coordinator.buffer import BufferClosed, RolloutBuffer


@dataclass
class G:
    min_version: int
    group_id: int = 0


def test_budget_never_empty_at_staleness_zero():
    # A budget of staleness * batch would be 0 here and stall; one batch per version is admitted.
    assert admission_budget(engine_version=0, max_staleness=0, batch_groups=4, consumed=0) == 4
    assert admission_budget(engine_version=3, max_staleness=0, batch_groups=4, consumed=12) == 4
    # the engine lagging one version behind the trainer shrinks the budget
    assert admission_budget(engine_version=2, max_staleness=0, batch_groups=4, consumed=12) == 0
    assert admission_budget(engine_version=2, max_staleness=2, batch_groups=4, consumed=12) == 8


def test_may_admit_counts_queued_and_in_flight():
    kw = dict(engine_version=1, max_staleness=1, batch_groups=2, consumed=2)
    assert may_admit(**kw, queued=0, in_flight=3)
    assert not may_admit(**kw, queued=1, in_flight=3)


def test_look_ahead_cap_admits_less_than_the_staleness_budget():
    kw = dict(engine_version=0, max_staleness=2, batch_groups=4, consumed=0)
    # the staleness budget alone allows 12 groups ahead; the cap allows 6
    assert may_admit(**kw, queued=5, in_flight=6)
    assert may_admit(**kw, queued=2, in_flight=3, max_ahead=6)
    assert not may_admit(**kw, queued=2, in_flight=4, max_ahead=6)
    # the staleness budget still rules when it is the smaller one
    assert not may_admit(**{**kw, "max_staleness": 0}, queued=0, in_flight=4, max_ahead=6)
    buf = RolloutBuffer(batch_groups=4, max_staleness=2, max_ahead=6)
    assert all(buf.wait_admit(0) for _ in range(6))
    assert not buf.wait_admit(0.01)
    for _ in range(4):
        buf.put(G(0))
    buf.get_batch(trainer_version=0, timeout=1)  # the trainer takes a batch: room again
    assert buf.wait_admit(0)


def test_stale_rule():
    assert not is_too_stale(5, 3, 2)
    assert is_too_stale(5, 2, 2)


def test_filtered_and_failed_groups_release_quota():
    buf = RolloutBuffer(batch_groups=2, max_staleness=0)
    assert buf.wait_admit(0) and buf.wait_admit(0)
    assert not buf.wait_admit(0.01)  # budget of one batch is used
    buf.discard("zero_variance")
    assert buf.wait_admit(0)  # quota came back at once, no sync needed
    buf.discard("reward_error")
    buf.put(G(0))
    assert buf.wait_admit(0)
    buf.put(G(0))
    assert buf.get_batch(trainer_version=0, timeout=1) == [G(0), G(0)]
    snap = buf.snapshot()
    assert (
        snap["admitted"]
        == snap["consumed"] + sum(snap["dropped"].values()) + snap["queued"] + snap["in_flight"]
    )


def test_a_batch_comes_in_admission_order_whatever_order_its_groups_finished():
    # a synchronous run with a fixed seed repeats only if the trainer sees its groups in
    # an order that does not depend on which generation finished first
    buf = RolloutBuffer(batch_groups=3, max_staleness=0)
    assert all(buf.wait_admit(0) for _ in range(3))
    for group_id in (7, 5, 6):  # the order they finished in
        buf.put(G(0, group_id))
    assert [g.group_id for g in buf.get_batch(trainer_version=0, timeout=1)] == [5, 6, 7]


def test_drop_at_consume_counts_stale_groups():
    buf = RolloutBuffer(batch_groups=1, max_staleness=1)
    for _ in range(3):
        buf.wait_admit(0)
    buf.put(G(0))
    buf.put(G(2))
    buf.put(G(3))
    assert buf.get_batch(trainer_version=3, timeout=1) == [G(2)]
    assert buf.dropped["stale"] == 1
    assert buf.staleness_seen == [1]


def test_carry_over_continues_the_counts_and_the_admission_budget():
    # a checkpoint at step 3 (3 batches of 2 consumed; 1 dropped; 2 then in flight)
    before = {"admitted": 9, "consumed": 6, "queued": 0, "in_flight": 2, "dropped": {"x": 1}}
    buf = RolloutBuffer(batch_groups=2, max_staleness=0)
    buf.carry_over(before)
    buf.set_engine_version(3)  # the resumed trainer's weights
    # the groups in flight then are served again: not carried, so the totals close
    snap = buf.snapshot()
    assert (snap["admitted"], snap["consumed"], snap["dropped"]) == (7, 6, {"x": 1})
    # one batch per version at staleness 0, as before the resume (a fresh buffer admits 8)
    assert buf.wait_admit(0) and buf.wait_admit(0)
    assert not buf.wait_admit(0.01)
    snap = buf.snapshot()
    assert (
        snap["admitted"]
        == snap["consumed"] + sum(snap["dropped"].values()) + snap["queued"] + snap["in_flight"]
    )


def test_get_batch_times_out_and_close_wakes_waiters():
    buf = RolloutBuffer(batch_groups=2, max_staleness=0)
    with pytest.raises(TimeoutError, match="no full batch"):
        buf.get_batch(0, timeout=0.05)
    errors = []

    def consumer():
        try:
            buf.get_batch(0)
        except BufferClosed:
            errors.append("closed")

    t = threading.Thread(target=consumer)
    t.start()
    buf.close()
    t.join(2)
    assert errors == ["closed"] and not t.is_alive()


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
@pytest.mark.parametrize("in_order", [True, False])
def test_simulated_pipeline_respects_bound_and_accounting(max_staleness, in_order):
    """Random producer/consumer interleavings: trained staleness never exceeds the bound.

    When groups finish in the order they started, the throttle alone keeps every group
    fresh; when they finish out of order, late ones are dropped at consume and counted.
    """
    rng = random.Random(max_staleness)
    batch = 3
    buf = RolloutBuffer(batch_groups=batch, max_staleness=max_staleness)
    in_flight = []  # versions at which running groups started
    trainer_version = engine_version = 0
    for _ in range(3000):
        action = rng.random()
        if action < 0.4 and buf.wait_admit(0):
            in_flight.append(engine_version)
        elif action < 0.75 and in_flight:
            started = in_flight.pop(0 if in_order else rng.randrange(len(in_flight)))
            if rng.random() < 0.1:
                buf.discard("filtered")
            else:
                buf.put(G(started))
        elif action < 0.9:
            try:
                buf.get_batch(trainer_version, timeout=0)
            except TimeoutError:
                continue
            trainer_version += 1
        elif engine_version < trainer_version:
            engine_version = trainer_version  # weight sync
            buf.set_engine_version(engine_version)
    assert trainer_version > 10
    assert max(buf.staleness_seen) <= max_staleness
    if in_order:
        assert buf.dropped["stale"] == 0
    snap = buf.snapshot()
    assert snap["in_flight"] == len(in_flight)
    assert (
        snap["admitted"]
        == snap["consumed"] + sum(snap["dropped"].values()) + snap["queued"] + snap["in_flight"]
    )
