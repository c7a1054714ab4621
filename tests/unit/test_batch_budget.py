"""`max_time_s` spent before a session's first step (run/session/batches.py): the abort
says which way it was spent. A resumed run's budget counts the sessions before it, so a
run resumed once its budget is gone stops at once; saying that no batch came and listing
slow rewards or dropped groups as causes would send its operator the wrong way."""

import threading
import time
from types import SimpleNamespace

import pytest

from asyncgrpo.run.session import RunAborted
from asyncgrpo.run.session.activity import Activity
from asyncgrpo.run.session.batches import BatchWaiter
from asyncgrpo.run.session.clock import RunClock


def waiter(clock: RunClock) -> BatchWaiter:
    """A waiter whose rollouts run and whose engine lives: only the clock can stop it."""
    return BatchWaiter(
        buffer=None,
        orchestrator=SimpleNamespace(fatal=None),
        link=SimpleNamespace(revive=lambda: None),
        clock=clock,
        activity=Activity(None),
        request_timeout_s=60,
        report=lambda: "trainer: waiting for a batch",
    )


def test_a_budget_the_resumed_sessions_spent_is_named_as_such():
    clock = RunClock(max_time_s=344)
    clock.resumed(step=2875, elapsed_s=345.2)
    with pytest.raises(RunAborted) as aborted:
        waiter(clock).next(threading.Event(), 2875)
    message = str(aborted.value)
    assert message.startswith("max_time_s (344 s) was spent before this session began")
    assert "had trained for 345 s up to step 2875" in message
    assert "--set max_time_s=" in message and "no batch came" not in message


def test_no_batch_within_the_budget_names_the_likely_causes_and_what_was_left():
    fresh = RunClock(max_time_s=0.05)
    time.sleep(0.1)
    with pytest.raises(RunAborted, match=r"^no batch came within max_time_s \(0.05 s\), so"):
        waiter(fresh).next(threading.Event(), 0)
    resumed = RunClock(max_time_s=300)
    resumed.resumed(step=40, elapsed_s=299.95)
    time.sleep(0.1)
    with pytest.raises(RunAborted) as aborted:
        waiter(resumed).next(threading.Event(), 40)
    message = str(aborted.value)
    assert message.startswith("no batch came within max_time_s (300 s) (the 0 s that earlier")
    assert "Likely causes" in message
