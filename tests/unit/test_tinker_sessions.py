"""Tinker sessions (asyncgrpo.tinker.sessions): alive while their client is heard from,
ended after the TTL of silence or when closed, and every later request of an ended
session refused with why it ended and what survives."""

import time

import pytest

from asyncgrpo.tinker.errors import TinkerUserError
from asyncgrpo.tinker.sessions import (
    CLOSED,
    EXPIRED,
    KEEP_ENDED,
    SessionEnded,
    SessionTable,
    owner_of,
)


def test_a_session_expires_only_after_the_ttl_without_a_word_from_its_client():
    table = SessionTable(ttl_s=10)
    now = time.monotonic()
    for session_id, silent_s in (("s1", 11), ("s2", 11), ("s3", 9)):
        table.add(session_id).last_seen = now - silent_s
    table.heard_from("s2:train:0")  # a request naming one of s2's models
    assert table.expired(now) == ["s1"]
    assert table.expired(now + 1) == ["s1", "s3"]


def test_an_ended_session_refuses_its_requests_with_why_and_what_survives():
    table = SessionTable(ttl_s=300)
    table.add("s1")
    table.add("s2")
    assert table.end("s1", EXPIRED) and not table.end("s1", CLOSED)  # the first end wins
    assert table.end("s2", CLOSED)
    with pytest.raises(SessionEnded) as expired:
        table.touch("s1:train:3", "model_id")
    message = str(expired.value)
    assert message.startswith("model_id: session s1 expired") and "--session-ttl" in message
    assert "create_training_client_from_state" in message
    with pytest.raises(SessionEnded, match="closed by its client"):
        table.get("s2")
    assert table.how_ended("s1") == EXPIRED and table.how_ended("s2") == CLOSED
    assert table.ended_total == {EXPIRED: 1, CLOSED: 1}
    with pytest.raises(TinkerUserError, match="unknown session"):
        table.get("s3")
    table.touch("not-a-session", "model_id")  # no session: left for the caller to refuse


def test_ended_sessions_are_remembered_within_a_bound():
    table = SessionTable(ttl_s=1)
    for i in range(KEEP_ENDED + 5):
        table.add(f"s{i}")
        table.end(f"s{i}", CLOSED)
    assert table.how_ended("s0") is None and table.how_ended(f"s{KEEP_ENDED + 4}") == CLOSED
    assert table.live == {}


def test_ids_name_their_session_and_the_ttl_is_checked():
    assert owner_of("session-ab12:train:0") == "session-ab12"
    assert owner_of("session-ab12:sample:3") == owner_of("session-ab12") == "session-ab12"
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="positive"):
            SessionTable(ttl_s=bad)
