"""The ledger of group outcomes: each group ends once, releases its prompt once, and a
checkpoint's record restores the same totals (the older two-counter format included)."""

from __future__ import annotations

from asyncgrpo.learning.coordinator.buffer import RolloutBuffer
from asyncgrpo.learning.coordinator.ledger import GroupLedger


class G:
    def __init__(self, position: int, min_version: int = 0):
        self.group_id, self.min_version = position, min_version


def test_every_end_is_counted_once_and_releases_its_prompt_once():
    released: list[int] = []
    ledger = GroupLedger(on_end=released.append)
    for _ in range(5):
        ledger.admit()
    ledger.consume([3, 4])
    ledger.drop("zero_variance", 1)
    ledger.drop("stale", 2)
    ledger.drop("generation_error", None)  # no prompt to release
    assert released == [3, 4, 1, 2]
    assert ledger.record() == {
        "admitted": 5,
        "consumed": 2,
        "dropped": {"zero_variance": 1, "stale": 1, "generation_error": 1},
        "failures": {"zero_variance": 1, "generation_error": 1},  # the drops but stale
    }


def test_a_record_restores_the_totals_and_the_older_format_is_not_counted_twice():
    # written before the ledger: `dropped` already held the failures, listed again apart
    older = {
        "admitted": 12,
        "consumed": 8,
        "queued": 1,
        "in_flight": 1,
        "dropped": {"stale": 1, "reward_error": 1},
        "failures": {"reward_error": 1},
        "engine_restarts": 0,
    }
    ledger = GroupLedger()
    ledger.restore(older)
    # the groups then queued or in flight are served again: not carried
    assert ledger.record() == {
        "admitted": 10,
        "consumed": 8,
        "dropped": {"stale": 1, "reward_error": 1},
        "failures": {"reward_error": 1},
    }
    again = GroupLedger()
    again.restore(ledger.record())
    assert again.record() == ledger.record()


def test_the_buffer_ends_each_group_in_exactly_one_place():
    released: list[int] = []
    buf = RolloutBuffer(batch_groups=1, max_staleness=0, on_group_end=released.append)
    assert buf.wait_admit(0)
    buf.discard("reward_error", 7)  # failed while being built
    assert buf.wait_admit(0)
    buf.put(G(8))
    assert buf.get_batch(trainer_version=0, timeout=1)[0].group_id == 8
    buf.set_engine_version(3)
    assert buf.wait_admit(0)
    buf.put(G(9, min_version=0))  # sampled at version 0, trained at 3: too stale
    assert buf.wait_admit(0)
    buf.put(G(10, min_version=3))
    assert buf.get_batch(trainer_version=3, timeout=1)[0].group_id == 10
    assert released == [7, 8, 9, 10]
    position, record = buf.record(lambda: "position")
    assert position == "position"
    assert record["dropped"] == {"reward_error": 1, "stale": 1}
    assert record["admitted"] == record["consumed"] + sum(record["dropped"].values()) == 4
