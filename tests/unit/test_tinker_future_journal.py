"""The Tinker futures' journal: each operation is told to the database as it is submitted
and as it ends (however it ends), under a request id that names the server process."""

from __future__ import annotations

import asyncio

from asyncgrpo.tinker.errors import TinkerUserError
from asyncgrpo.tinker.futures import FutureTable, Outcome, boot_of


class Journal:
    def __init__(self):
        self.events = []

    def submitted(self, request_id, owner, subject, kind, seq_id):
        self.events.append(("submitted", request_id, owner, subject, kind, seq_id))

    def finished(self, request_id, outcome):
        self.events.append(("finished", request_id, outcome))


def test_every_operation_is_journaled_from_submission_to_its_end():
    async def scenario():
        journal, release = Journal(), asyncio.Event()
        table = FutureTable(journal=journal, boot="be11")

        async def ok():
            return Outcome(json={"type": "optim_step"})

        async def refused():
            raise TinkerUserError("seq_id", "already used")

        async def stuck():
            await release.wait()
            return Outcome(json={})

        done = table.submit(
            ("m", 1), ok, owner="s", kind="optim_step", subject="s:train:0", seq_id=1
        )
        bad = table.submit(None, refused, owner="s", kind="forward")
        cut = table.submit(None, stuck, owner="s", kind="sample", subject="s:sample:0")
        assert table.submit(("m", 1), ok, owner="s") == done  # a resubmission: not journaled
        await asyncio.sleep(0.01)
        table.fail_owned("s", {"error": "session s expired", "category": "user"})
        await table.close()
        return journal.events, (done, bad, cut), table

    events, (done, bad, cut), table = asyncio.run(scenario())
    assert [boot_of(r) for r in (done, bad, cut)] == ["be11"] * 3 and len({done, bad, cut}) == 3
    assert events[:3] == [
        ("submitted", done, "s", "s:train:0", "optim_step", 1),
        ("submitted", bad, "s", None, "forward", None),
        ("submitted", cut, "s", "s:sample:0", "sample", None),
    ]
    ends = {e[1]: e[2] for e in events if e[0] == "finished"}
    assert len(ends) == 3 and len(events) == 6  # each ended once
    assert ends[done].json == {"type": "optim_step"}
    assert ends[bad].error == {"error": "seq_id: already used", "category": "user"}
    assert ends[cut].error["error"] == "session s expired"
    assert table.knows(done) and not table.knows("req-be11-99")


def test_request_ids_of_other_forms_name_no_process():
    assert boot_of("req-0a1b-12") == "0a1b"
    for other in ("req-12", "req-0a1b-", "req-xyz-3", "anything"):
        assert boot_of(other) is None
    fresh = FutureTable()  # a random token per process, which the ids it issues carry
    assert boot_of(f"req-{fresh.boot}-1") == fresh.boot != FutureTable().boot
