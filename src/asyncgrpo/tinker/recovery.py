"""What a poll for an operation that this process does not hold in memory is answered.

Such an operation was issued by the server process before this one (it was killed, or it
stopped), or it finished long enough ago that memory let it go. The database's record of it
(`store.TinkerStore.finished`) tells what became of it:

- it ended: its error, or its JSON answer (a saved path survives the restart with the file
  it names); an answer that was protobuf bytes (log-probs, samples) lived in memory only;
- it was still running when its process died, or no record of it was committed before the
  death (the request id still names the process that issued it): it is lost.

Each of these is a definite answer: the SDK raises `RequestFailedError` with the message at
once, rather than polling forever or retrying a bare 400. The message names the model's last
saved state, from which a new client resumes.
"""

from __future__ import annotations

import asyncio

from asyncgrpo.inference.server.request_log import note
from asyncgrpo.tinker.futures import Outcome, boot_of


async def answer_from_records(svc, request_id: str) -> Outcome | None:
    """The answer to a poll for `request_id` from the database of the service `svc`
    (`recorded_outcome`); a second later when it is this process's and still running."""
    row = await asyncio.to_thread(svc.store.future, request_id)
    model = None
    if row is not None and row.model_id:
        model = await asyncio.to_thread(svc.store.model, row.model_id)
    note(session=row.session_id if row else None, request_id=request_id)
    state_path = model.state_path if model is not None else None
    outcome = recorded_outcome(request_id, row, svc.store.boot, state_path)
    if outcome is None:  # its end is not committed yet: the client asks again
        await asyncio.sleep(1.0)
    elif outcome.error is not None:
        note(error=outcome.error.get("error"))
    return outcome


def _resume_hint(state_path: str | None) -> str:
    if state_path:
        return (
            f"; its model's last saved state is {state_path}: resume from it with a new "
            "ServiceClient().create_training_client_from_state_with_optimizer(path)"
        )
    return "; what its session saved loads in a new ServiceClient"


def recorded_outcome(request_id: str, row, boot: str, state_path: str | None) -> Outcome | None:
    """The answer to a poll for `request_id`, which memory does not hold: from its record
    `row` (None if none), this process's `boot` token, and its model's `state_path`. None
    while it is this process's and still running (its end is not committed yet); a
    `KeyError` for an id no process of this server issued."""
    issuer = boot_of(request_id)
    if row is None:
        if issuer is None or issuer == boot:
            raise KeyError(request_id)
        return _lost(
            f"request {request_id} was lost when tinker-serve stopped (the server restarted "
            "since) before the operation was recorded: whether it ran is unknown"
            + _resume_hint(state_path)
        )
    if row.status == "pending":
        if issuer == boot:
            return None
        return _lost(
            f"request {request_id} ({row.kind} on {row.model_id}) was still running when "
            "tinker-serve stopped (the server restarted since): its result is lost"
            + _resume_hint(state_path)
        )
    if row.status == "failed":
        category = row.error_category or "server"
        return Outcome(error={"error": row.error or "failed", "category": category})
    if row.result is not None:
        return Outcome(json=row.result)
    return _lost(
        f"request {request_id} ({row.kind} on {row.model_id}) finished, but its result "
        "(protobuf) was kept in memory only, which no longer holds it (the server restarted, "
        "or the result waited too long to be fetched)" + _resume_hint(state_path)
    )


def _lost(message: str) -> Outcome:
    # "server": not the client's mistake. The SDK raises it at once, as it does a user error.
    return Outcome(error={"error": message, "category": "server"})
