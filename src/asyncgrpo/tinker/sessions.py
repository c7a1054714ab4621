"""Tinker sessions: alive while their client speaks, ended after `--session-ttl` of silence.

Every model and sampler a client creates belongs to its session (their ids start with the
session id), and holds memory: a LoRA adapter, its Adam moments, snapshot weights. A client
that exits without a goodbye would leave them in memory until the server stops, so a
session ends when its client has been silent for the TTL, or at once when the client
closes it (`ServiceClient.close` posts `/sessions/{id}/finish`). What the session saved
under `tinker://` paths stays on disk and loads in any later session.

The SDK (0.38) posts `/session_heartbeat` every 10 s from its own event-loop thread,
whatever the user's code is doing, and warns after 120 s of failed heartbeats that the
session "will be terminated". A session hears from its client through those heartbeats and
through every request that names the session, one of its models or samplers, or polls one
of its futures (a poll is answered within half the TTL, so a client waiting on a long
operation asks again in time). The default TTL, 300 s, is 30 heartbeat periods: a client
paused for a minute or two (a debugger, a slow network) is not taken for gone, and its user
sees the SDK's own warning well before the end; an abandoned client's memory comes back
within minutes.

A server that stops (killed, or shut down) takes its sessions with it: their models' state
since their last save lives in its memory only. The next server on the same database ends
them as `restarted` at its start (`store.TinkerStore.end_live_sessions`) and remembers the
sessions that ended last, so their clients learn why, as those of expired ones do.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from asyncgrpo.tinker.errors import TinkerUserError

DEFAULT_TTL_S = 300.0
SDK_HEARTBEAT_S = 10.0  # the SDK's period (`InternalClientHolder._session_heartbeat`)
KEEP_ENDED = 16384  # ended sessions remembered, so that their clients learn why
EXPIRED, CLOSED, RESTARTED = "expired", "closed", "restarted"


class SessionEnded(TinkerUserError):
    """A request for a session that has ended: what ended it and what survives."""


@dataclass
class Session:
    session_id: str
    started: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)


def owner_of(some_id: str) -> str:
    """The session a model, sampler or session id belongs to (`s:train:0` → `s`)."""
    return some_id.split(":", 1)[0]


class SessionTable:
    """Live sessions with the time each last heard from its client, and why ended ones ended."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S):
        if not ttl_s > 0:
            raise ValueError(f"the session TTL must be positive seconds, got {ttl_s!r}")
        self.ttl_s = float(ttl_s)
        self.live: dict[str, Session] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()
        self.ended_total = {EXPIRED: 0, CLOSED: 0}  # and RESTARTED, after a restart

    def add(self, session_id: str) -> Session:
        session = self.live[session_id] = Session(session_id)
        return session

    def get(self, session_id: str, field_name: str = "session_id") -> Session:
        """The live session, its client heard from now; refused if ended or unknown."""
        session = self.live.get(session_id)
        if session is None:
            self.refuse_if_ended(session_id, field_name)
            raise TinkerUserError(field_name, f"unknown session {session_id!r}")
        session.last_seen = time.monotonic()
        return session

    def touch(self, some_id: str, field_name: str) -> None:
        """A request named `some_id` (a session, model or sampler id): its session's client
        is alive. An ended session's request is refused with why it ended; an id of no
        session passes, for the caller to refuse as unknown."""
        if not self.heard_from(some_id):
            self.refuse_if_ended(owner_of(some_id), field_name)

    def heard_from(self, some_id: str) -> bool:
        """The client of `some_id`'s session is alive (if the session is); whether it is."""
        session = self.live.get(owner_of(some_id))
        if session is not None:
            session.last_seen = time.monotonic()
        return session is not None

    def refuse_if_ended(self, session_id: str, field_name: str) -> None:
        how = self._ended.get(session_id)
        if how is not None:
            raise SessionEnded(field_name, self.ended_message(session_id, how))

    def is_ended(self, session_id: str) -> bool:
        return session_id in self._ended

    def how_ended(self, session_id: str) -> str | None:
        """EXPIRED, CLOSED, or None for a live or unknown session."""
        return self._ended.get(session_id)

    def expired(self, now: float | None = None) -> list[str]:
        """Live sessions that have not heard from their client for the TTL."""
        now = time.monotonic() if now is None else now
        return [s.session_id for s in self.live.values() if now - s.last_seen >= self.ttl_s]

    def end(self, session_id: str, how: str) -> bool:
        """End a live session (`how`: EXPIRED or CLOSED); False if it was not live."""
        if self.live.pop(session_id, None) is None:
            return False
        self.remember_ended(session_id, how)
        self.ended_total[how] += 1
        return True

    def remember_ended(self, session_id: str, how: str) -> None:
        """Know `session_id` as ended `how` (one that ended before this server started)."""
        self._ended[session_id] = how
        self._ended.move_to_end(session_id)
        while len(self._ended) > KEEP_ENDED:
            self._ended.popitem(last=False)

    def ended_message(self, session_id: str, how: str) -> str:
        if how == EXPIRED:
            why = (
                f"expired: its client sent no heartbeat or request for {self.ttl_s:g} s "
                "(tinker-serve --session-ttl)"
            )
        elif how == RESTARTED:
            why = (
                "ended when tinker-serve stopped (it has restarted since): its models' "
                "state since their last save_state, its samplers and its pending operations "
                "died with that process"
            )
        else:
            why = "was closed by its client (ServiceClient.close)"
        return (
            f"session {session_id} {why}; its models and samplers were released. What it "
            "saved (save_state, save_weights_for_sampler) loads in a new session, e.g. "
            "ServiceClient().create_training_client_from_state_with_optimizer(path); "
            "RestClient.list_checkpoints(model_id) lists a model's saved paths"
        )
