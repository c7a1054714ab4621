"""The Tinker server's futures: seq_id order whatever the arrival order, deduplicated
resubmissions, long-polls that answer "pending" instead of hanging, failures as bodies."""

import asyncio

import pytest

from asyncgrpo.tinker.errors import TinkerUserError
from asyncgrpo.tinker.futures import FutureTable, Outcome, SeqOrder


def run(coroutine):
    return asyncio.run(coroutine)


def test_operations_run_in_seq_id_order_whatever_order_they_arrive_in():
    async def scenario():
        order, ran = SeqOrder(), []

        async def op(seq_id):
            async def work():
                ran.append(seq_id)
                await asyncio.sleep(0)

            await order.run(seq_id, work)

        # chunks arrive concurrently, the first one last (as the SDK sends them)
        await asyncio.gather(*(op(s) for s in [3, 5, 2, 4, 1]))
        return ran

    assert run(scenario()) == [1, 2, 3, 4, 5]


def test_a_failed_operation_still_lets_the_next_seq_id_run():
    async def scenario():
        order = SeqOrder()

        async def fail():
            raise TinkerUserError("loss_fn", "bad")

        async def ok():
            return "ran"

        second = asyncio.create_task(order.run(2, ok))
        with pytest.raises(TinkerUserError):
            await order.run(1, fail)
        return await asyncio.wait_for(second, 5)

    assert run(scenario()) == "ran"


def test_a_reused_seq_id_is_refused():
    async def scenario():
        order = SeqOrder()

        async def ok():
            return None

        await order.run(1, ok)
        await order.run(1, ok)

    with pytest.raises(TinkerUserError, match="already used"):
        run(scenario())


def test_resubmissions_share_one_future_and_run_once():
    async def scenario():
        table, calls = FutureTable(), []

        async def work():
            calls.append(1)
            return Outcome(json={"ok": True})

        first = table.submit(("model", 1), work)
        again = table.submit(("model", 1), work)
        other = table.submit(("model", 2), work)
        results = [await table.retrieve(r, 5) for r in (first, again, other)]
        return first, again, other, calls, results

    first, again, other, calls, results = run(scenario())
    assert first == again != other
    assert len(calls) == 2
    assert all(r.json == {"ok": True} for r in results)


def test_a_long_poll_answers_pending_then_the_result():
    async def scenario():
        table, release = FutureTable(), asyncio.Event()

        async def work():
            await release.wait()
            return Outcome(proto=b"\x01")

        request_id = table.submit(None, work)
        pending = await table.retrieve(request_id, 0.05)
        release.set()
        done = await table.retrieve(request_id, 5)
        return pending, done

    pending, done = run(scenario())
    assert pending is None
    assert done.proto == b"\x01"


def test_failures_become_error_bodies_with_their_category():
    async def scenario():
        table = FutureTable()

        async def user():
            raise TinkerUserError("advantages", "has 3 values, the model input 4")

        async def bug():
            raise RuntimeError("boom")

        return [await table.retrieve(table.submit(None, w), 5) for w in (user, bug)]

    user, bug = run(scenario())
    assert user.error["category"] == "user" and "advantages" in user.error["error"]
    assert bug.error["category"] == "server" and "boom" in bug.error["error"]


def test_unknown_request_ids_raise_key_error():
    async def scenario():
        await FutureTable().retrieve("req-404", 0.01)

    with pytest.raises(KeyError):
        run(scenario())


def test_an_ended_session_fails_its_pending_futures_and_stops_the_queued_ones():
    """`fail_owned`: the owner's pending futures answer the error at once; interruptible
    work queued behind others never runs, uninterruptible work runs on with its result
    dropped; other owners' futures and finished results are untouched."""

    async def scenario():
        table, order, release, ran = FutureTable(), SeqOrder(), asyncio.Event(), []

        def op(name, seq_id=None, in_order=True):
            async def work():
                await release.wait()
                ran.append(name)
                return Outcome(json={"op": name})

            return (lambda: order.run(seq_id, work)) if in_order else work

        done = table.submit(None, lambda: _outcome("finished before"), owner="s1")
        await table.retrieve(done, 5)
        running = table.submit(None, op("running", 1), owner="s1")
        queued = table.submit(None, op("queued", 2), owner="s1")
        engine = table.submit(None, op("engine", in_order=False), owner="s1", interruptible=False)
        other = table.submit(None, op("other", in_order=False), owner="s2")
        await asyncio.sleep(0)
        depth_before = order.depth
        failed = table.fail_owned("s1", {"error": "session s1 expired", "category": "user"})
        outcomes = {
            n: await table.retrieve(r, 0.01)
            for n, r in [("running", running), ("queued", queued), ("engine", engine)]
        }
        release.set()
        other_outcome = await table.retrieve(other, 5)
        await asyncio.sleep(0.05)
        return (failed, depth_before, outcomes, other_outcome, ran, table, done)

    failed, depth_before, outcomes, other_outcome, ran, table, done = run(scenario())
    assert failed == 3 and depth_before == 2
    assert all(
        o.error == {"error": "session s1 expired", "category": "user"} for o in outcomes.values()
    )
    assert other_outcome.json == {"op": "other"}
    assert sorted(ran) == ["engine", "other"]  # the cancelled ones never ran
    assert table.pending == 0 and table.pending_owned("s1") == 0


async def _outcome(name):
    return Outcome(json={"op": name})
