"""Staleness rules as pure functions, so they can be reasoned about and tested alone.

Versions count optimizer steps: the trainer is at version `v` after `v` steps,
and the engine samples with the last version it was sent. A sample's staleness
when trained at version `v` is `v - oldest_token_version`.

Admission follows AReaL's throttle, expressed with what the buffer can count: a
new group may start while

    consumed + queued + in_flight < (engine_version + max_staleness + 1) * batch_groups

The group that starts now will be trained at step `(consumed + queued + in_flight)
// batch_groups` or later, and its tokens are at least `engine_version`, so the
inequality bounds its staleness by `max_staleness`. With `max_staleness = 0` it
admits exactly one batch per weight version: synchronous on-policy GRPO through
the same code path. Unlike a `staleness * batch` in-flight limit (which is 0 at
staleness 0 and stalls), the budget is never empty; filtered, failed and dropped
groups leave `queued + in_flight` without entering `consumed`, so they release
their quota at once and the throttle can never deadlock.

The staleness bound is a ceiling, not a target. When the engine is faster than
the trainer, filling the whole budget only makes every sample `max_staleness`
steps old. An optional look-ahead cap, `queued + in_flight < max_ahead`, admits
just enough work to have the next batch ready when the trainer asks for it, so
samples are as fresh as the throughput allows.
"""

from __future__ import annotations


def admission_budget(
    engine_version: int, max_staleness: int, batch_groups: int, consumed: int
) -> int:
    """How many groups may be queued or in flight right now (>= 0)."""
    return max(0, (engine_version + max_staleness + 1) * batch_groups - consumed)


def may_admit(
    *,
    engine_version: int,
    max_staleness: int,
    batch_groups: int,
    consumed: int,
    queued: int,
    in_flight: int,
    max_ahead: int | None = None,
) -> bool:
    """True when one more group may start generating."""
    budget = admission_budget(engine_version, max_staleness, batch_groups, consumed)
    if max_ahead is not None:
        budget = min(budget, max_ahead)
    return queued + in_flight < budget


def min_version(versions: list[int]) -> int:
    """The oldest weight version among sampled tokens (−1 marks inserted ones); 0 if none."""
    sampled = [v for v in versions if v >= 0]
    return min(sampled) if sampled else 0


def staleness(trainer_version: int, oldest_token_version: int) -> int:
    """How many optimizer steps behind the trainer the oldest token of a sample is."""
    return trainer_version - oldest_token_version


def is_too_stale(trainer_version: int, oldest_token_version: int, max_staleness: int) -> bool:
    """Drop-at-consume rule: a group older than the bound is dropped (and counted)."""
    return staleness(trainer_version, oldest_token_version) > max_staleness
