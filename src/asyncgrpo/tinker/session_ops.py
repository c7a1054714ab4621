"""Sessions of the Tinker service begin and end: recorded, released, expired, remembered.

A session is recorded in the database before its id is given out. It ends when its client
closes it or falls silent for the TTL (`sessions.py`): its pending operations fail saying
why, its samplers leave memory at once, its models once the operation the trainer is
running is done (on the trainer's thread, in turn); what it saved stays on disk and in the
database. At start, the sessions this server's stopped process left live are ended as
`restarted` and the sessions that ended last are remembered, so that their clients are told
why rather than "unknown session". Outcomes older than a day are forgotten hourly.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

from asyncgrpo.inference.server.request_log import note
from asyncgrpo.tinker.sessions import CLOSED, EXPIRED, KEEP_ENDED, RESTARTED, owner_of

logger = logging.getLogger(__name__)


async def create_session(svc, user_metadata: dict | None = None) -> dict:
    """A new session, recorded before its id is given out."""
    session_id = f"session-{secrets.token_hex(6)}"
    await asyncio.wrap_future(svc.store.session_started(session_id, user_metadata))
    svc.sessions.add(session_id)
    note(session=session_id)
    return {"type": "create_session", "session_id": session_id}


def finish_session(svc, session_id: str) -> None:
    """The client closed the session: it ends now (closing an ended one again is a no-op,
    as the SDK's first-wins finish reason has it)."""
    if not svc.sessions.is_ended(session_id):
        svc.session(session_id)
        end_session(svc, session_id, CLOSED)


def end_session(svc, session_id: str, how: str) -> None:
    """End a live session (`how`: sessions.EXPIRED or CLOSED); see the module docstring."""
    if not svc.sessions.end(session_id, how):
        return
    svc.store.session_ended(session_id, how)
    error = {"error": svc.sessions.ended_message(session_id, how), "category": "user"}
    failed = svc.futures.fail_owned(session_id, error)
    svc.samplers.remove_owned(session_id)
    release = svc._trainer.submit(release_models, svc, session_id)
    release.add_done_callback(_log_failure)
    logger.info("session %s %s; %d pending operations failed", session_id, how, failed)


def release_models(svc, session_id: str) -> None:
    """Trainer thread: the session's models leave memory (adapter, Adam state, the
    snapshot its samplers follow), or the disk where they were offloaded."""
    owned = {*svc._order, *svc.latest, *svc.models.models}
    for model_id in [m for m in owned if owner_of(m) == session_id]:
        svc._order.pop(model_id, None)
        svc.latest.pop(model_id, None)
        svc.offload.forget(model_id)
        if model_id in svc.models.models:
            svc.models.remove(model_id)


async def expire_sessions(svc) -> None:
    """End the sessions whose clients have been silent for the TTL, checked a few times
    per TTL (at most every 10 s)."""
    period = min(svc.sessions.ttl_s / 4, 10.0)
    while True:
        await asyncio.sleep(period)
        for session_id in svc.sessions.expired():
            try:
                end_session(svc, session_id, EXPIRED)
            except Exception:  # a bug here must not stop every later expiry
                logger.exception("ending session %s failed", session_id)


async def learn_ended_sessions(svc) -> None:
    """End the sessions this server's stopped process left live, and remember how the
    sessions that ended last ended (those included)."""
    restarted = await asyncio.to_thread(svc.store.end_live_sessions)
    for session_id, how in await asyncio.to_thread(svc.store.recently_ended, KEEP_ENDED):
        svc.sessions.remember_ended(session_id, how)
    if restarted:
        logger.info("%d sessions ended with the server's last process", len(restarted))
        svc.sessions.ended_total[RESTARTED] = len(restarted)


async def forget_old_outcomes(svc, period_s: float = 3600.0) -> None:
    while True:
        svc.store.forget_old_outcomes()
        await asyncio.sleep(period_s)


def _log_failure(future) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.error("releasing a session's models failed", exc_info=future.exception())
