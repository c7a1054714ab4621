"""Engine replicas, on fakes of the member backends and their clients.

`RoutedClient`: least outstanding work wins, equals take turns, an episode's
calls stay on its replica, a replica marked down gets no new work while
another is up. `ReplicaBackend`: syncs run on all members at once and only a
member's `EngineDied` ends them; a member that dies is restarted in the
background without holding up a sync, and gets no work until the current
weights reach it (`revive` says so until they have).
(`tests/integration/test_replicas.py` runs the same on real engine processes.)
"""

from __future__ import annotations

import asyncio

import pytest

from asyncgrpo.base.engine_errors import EngineDied, EngineRefused
from asyncgrpo.inference.backend.replicas import ReplicaBackend
from asyncgrpo.inference.client.router import RoutedClient


class FakeClient:
    """The calls of an `EngineClient` a builder makes; `hold` keeps completions in flight."""

    def __init__(self, name: str):
        self.base_url = f"http://{name}"
        self.hold: asyncio.Event | None = None
        self.completed: list[int] = []  # n of each completion served
        self.open: set[str] = set()
        self.opened = 0
        self.answers = True

    async def complete(self, prompt_ids, *, n=1, **kw):
        if self.hold is not None:
            await self.hold.wait()
        self.completed.append(n)
        return self.base_url

    async def chat(self, messages, *, n=1, **kw):
        return await self.complete(messages, n=n)

    async def open_episode(self, max_turns=None):
        self.opened += 1
        episode_id = f"{self.base_url}-{self.opened}"
        self.open.add(episode_id)
        return {"episode_id": episode_id, "base_url": f"{self.base_url}/e/{episode_id}/v1"}

    async def close_episode(self, episode_id, reward, stop_reason="ok", tool_failures=0):
        self.open.remove(episode_id)  # KeyError: the call reached the wrong replica
        return {"episode_id": episode_id, "reward": reward}

    async def episode_info(self, episode_id):
        assert episode_id in self.open, "episode_info reached the wrong replica"
        return {"episode_id": episode_id}

    async def episode_stats(self):
        return {"open": len(self.open), "opened": self.opened}

    async def server_info(self):
        return {"model": "m", "stats": {"busy_seconds": 1.5, "weight_version": self.opened}}

    async def health(self):
        return self.answers


class FakeMember:
    """A member backend: `dead` until `revive` restarts it (held while `restart_gate` is
    unset), `client.answers` for its health check, syncs that can wait or fail."""

    def __init__(self, name: str):
        self.client = FakeClient(name)
        self.restarts = 0
        self.dead = False
        self.cannot_restart = False
        self.restart_gate: asyncio.Event | None = None
        self.synced: list[int] = []
        self.sync_error: Exception | None = None
        self.sync_entered = asyncio.Event()
        self.sync_gate: asyncio.Event | None = None
        self.launched = self.closed = False
        self.sync_timings: dict[str, float] = {}

    @property
    def base_urls(self):
        return [self.client.base_url]

    def launch(self):
        self.launched = True

    async def wait_ready(self, layout=None):
        return None

    async def healthy(self):
        return not self.dead and self.client.answers

    async def revive(self):
        if not self.dead:
            return False
        if self.restart_gate is not None:
            await self.restart_gate.wait()
        if self.cannot_restart:
            raise EngineDied("the engine could not be restarted: no memory")
        self.restarts += 1
        self.dead = False
        return True

    async def sync_weights(self, weights, version, mode):
        self.sync_entered.set()
        if self.sync_gate is not None:
            await self.sync_gate.wait()
        if self.sync_error is not None:
            raise self.sync_error
        self.synced.append(version)
        self.sync_timings = {"pause_s": float(self.client.base_url[-1]), "paused_s": version}

    async def close(self):
        self.closed = True


async def in_flight(client: RoutedClient, n: int) -> asyncio.Task:
    """A completion of `n` sequences that stays in flight until its replica's hold is set."""
    task = asyncio.ensure_future(client.complete([1, 2], n=n))
    await asyncio.sleep(0)  # it has chosen its replica
    return task


def held_clients(count: int) -> list[FakeClient]:
    clients = [FakeClient(f"r{i}") for i in range(count)]
    for c in clients:
        c.hold = asyncio.Event()
    return clients


# ---- routing ---------------------------------------------------------------------------


def test_new_work_goes_to_the_replica_with_the_fewest_outstanding_sequences():
    async def scenario():
        clients = held_clients(2)
        router = RoutedClient(clients)
        big = await in_flight(router, 4)  # replica 0: 4 outstanding
        small = await in_flight(router, 1)  # replica 1: fewer
        assert [c.outstanding for c in router.counts] == [4, 1]
        assert router.pick() == 1 and router.pick() == 1  # 1 < 4, however many ask
        await in_flight(router, 2)  # replica 1: 3 < 4
        assert [c.outstanding for c in router.counts] == [4, 3]
        for c in clients:
            c.hold.set()
        await asyncio.gather(big, small)
        await asyncio.sleep(0)
        assert [c.outstanding for c in router.counts] == [0, 0]
        assert [c.requests for c in router.counts] == [1, 2]
        assert [c.sequences for c in router.counts] == [4, 3]
        assert clients[0].completed == [4] and sorted(clients[1].completed) == [1, 2]

    asyncio.run(scenario())


def test_equally_loaded_replicas_take_turns():
    async def scenario():
        router = RoutedClient([FakeClient(f"r{i}") for i in range(3)])
        served = [await router.complete([1], n=2) for _ in range(7)]
        assert served == ["http://r0", "http://r1", "http://r2"] * 2 + ["http://r0"]
        assert [c.requests for c in router.counts] == [3, 2, 2]
        assert all(c.outstanding == 0 for c in router.counts)

    asyncio.run(scenario())


def test_an_episode_stays_on_the_replica_that_opened_it_and_counts_as_outstanding():
    async def scenario():
        clients = [FakeClient("r0"), FakeClient("r1")]
        router = RoutedClient(clients)
        first = await router.open_episode(max_turns=3)
        second = await router.open_episode()
        assert first["base_url"].startswith("http://r0/e/")
        assert second["base_url"].startswith("http://r1/e/")
        third = await router.open_episode()  # equal again: replica 0's turn
        assert third["base_url"].startswith("http://r0/e/")
        assert [c.outstanding for c in router.counts] == [2, 1]
        assert await router.complete([5], n=1) == "http://r1"  # 1 open episode < 2
        await router.episode_info(third["episode_id"])
        closed = await router.close_episode(third["episode_id"], 1.0)
        assert closed == {"episode_id": third["episode_id"], "reward": 1.0}
        assert clients[0].open == {first["episode_id"]}
        assert [c.outstanding for c in router.counts] == [1, 1]
        assert [c.episodes for c in router.counts] == [2, 1]
        with pytest.raises(EngineRefused) as again:  # as the server refuses a second close
            await router.close_episode(third["episode_id"], 1.0)
        assert again.value.status == 404
        stats = await router.episode_stats()
        assert stats["open"] == 2 and stats["opened"] == 3
        assert stats["replicas"] == {0: {"open": 1, "opened": 2}, 1: {"open": 1, "opened": 1}}

    asyncio.run(scenario())


def test_concurrent_opens_spread_before_any_answer():
    async def scenario():
        router = RoutedClient([FakeClient("r0"), FakeClient("r1")])
        opened = await asyncio.gather(*(router.open_episode() for _ in range(6)))
        hosts = [o["base_url"].split("/e/")[0] for o in opened]
        assert hosts.count("http://r0") == hosts.count("http://r1") == 3

    asyncio.run(scenario())


def test_a_replica_marked_down_gets_no_new_work_while_another_is_up():
    async def scenario():
        router = RoutedClient([FakeClient("r0"), FakeClient("r1"), FakeClient("r2")])
        router.set_up(1, False)
        served = [await router.complete([1]) for _ in range(4)]
        assert "http://r1" not in served
        opened = await router.open_episode()
        assert not opened["base_url"].startswith("http://r1")
        for i in (0, 2):
            router.set_up(i, False)
        assert await router.complete([1]) in {"http://r0", "http://r1", "http://r2"}  # all down
        router.set_up(1, True)
        assert await router.complete([1]) == "http://r1"
        info = await router.server_info()  # only replicas that are up are asked
        assert set(info["replicas"]) == {1} and info["stats"]["busy_seconds"] == 1.5

    asyncio.run(scenario())


def test_server_info_combines_the_live_replicas():
    async def scenario():
        clients = [FakeClient("r0"), FakeClient("r1")]
        router = RoutedClient(clients)
        await clients[1].open_episode()  # its fake weight_version becomes 1
        info = await router.server_info()
        assert info["model"] == "m"
        assert info["stats"] == {"busy_seconds": 3.0, "weight_version": 0}  # summed; oldest
        clients[0].answers = False
        assert await router.health()  # one replica answers
        clients[1].answers = False
        assert not await router.health()

    asyncio.run(scenario())


# ---- the backend -----------------------------------------------------------------------


def replica_backend(count: int = 2, period: float = 1000.0) -> tuple[ReplicaBackend, list]:
    members = [FakeMember(f"r{i}") for i in range(count)]
    return ReplicaBackend(members, health_period_s=period), members


def test_a_sync_reaches_every_member_at_once():
    async def scenario():
        backend, members = replica_backend(3)
        backend.launch()
        await backend.wait_ready()
        everyone_in = asyncio.Event()
        for m in members:
            m.sync_gate = everyone_in
        sync = asyncio.ensure_future(backend.sync_weights([], 7, "keep"))
        # every member entered its sync before any finished: they run together
        await asyncio.wait_for(asyncio.gather(*(m.sync_entered.wait() for m in members)), 5)
        everyone_in.set()
        await sync
        assert [m.synced for m in members] == [[7], [7], [7]]
        assert backend.sync_timings == {"pause_s": 2.0, "paused_s": 7}  # the slowest member
        assert all(m.launched for m in members)
        await backend.close()
        assert all(m.closed for m in members)

    asyncio.run(scenario())


def dies_in_sync(member: FakeMember) -> None:
    """The member passes the probe before the sync, then dies in it (once)."""
    sync = member.sync_weights

    async def dying(weights, version, mode):
        member.sync_weights = sync
        member.dead = True
        raise EngineDied("the engine died during weight sync")

    member.sync_weights = dying


def test_a_member_that_dies_in_its_sync_restarts_in_the_background_and_is_skipped():
    async def scenario():
        backend, members = replica_backend(2)
        await backend.wait_ready()
        assert [m.sync_attempts for m in members] == [1, 1]  # no member retries inline
        dies_in_sync(members[0])
        members[0].restart_gate = asyncio.Event()
        members[1].sync_gate = asyncio.Event()
        sync = asyncio.ensure_future(backend.sync_weights([], 2, "keep"))
        await members[1].sync_entered.wait()
        await asyncio.sleep(0.01)
        assert not sync.done()  # it waits for member 1
        members[1].sync_gate.set()
        await sync  # member 0's death does not fail the sync
        assert [m.synced for m in members] == [[], [2]]
        assert not backend.client.counts[0].up and backend.client.counts[1].up
        members[0].restart_gate.set()
        await settle(backend)
        assert members[0].restarts == 1
        assert await backend.revive() is True  # back, without the weights: re-send them
        await backend.sync_weights([], 2, "keep")
        assert backend.client.counts[0].up and members[0].synced == [2]

    asyncio.run(scenario())


def test_a_member_that_dies_in_its_sync_and_cannot_come_back_ends_the_run():
    async def scenario():
        backend, members = replica_backend(2)
        dies_in_sync(members[0])
        members[0].cannot_restart = True
        await backend.sync_weights([], 2, "keep")
        await settle(backend)
        with pytest.raises(EngineDied, match="engine replica 0: the engine could not be"):
            await backend.sync_weights([], 3, "keep")
        assert members[1].synced == [2]

    asyncio.run(scenario())


def test_a_dead_member_restarts_in_the_background_and_returns_after_a_sync():
    async def scenario():
        backend, members = replica_backend(2)
        await backend.wait_ready()
        router = backend.client
        members[0].dead = True
        members[0].restart_gate = asyncio.Event()
        assert await backend.revive() is False  # restart started, not finished
        assert not router.counts[0].up
        assert [await router.complete([1]) for _ in range(3)] == ["http://r1"] * 3
        await backend.sync_weights([], 1, "keep")  # skips the member still restarting
        assert [m.synced for m in members] == [[], [1]]
        members[0].restart_gate.set()
        await settle(backend)
        assert backend.restarts == 1
        assert not router.counts[0].up  # back, but with its initial weights
        assert await backend.revive() is True  # the run re-sends the weights ...
        assert await backend.revive() is True  # ... whenever it asks, until it has
        assert not router.counts[0].up
        await backend.sync_weights([], 1, "keep")
        assert [m.synced for m in members] == [[1], [1, 1]]
        assert await backend.revive() is False
        assert router.counts[0].up
        assert {await router.complete([1]) for _ in range(2)} == {"http://r0", "http://r1"}

    asyncio.run(scenario())


async def settle(backend: ReplicaBackend) -> None:
    """Let the background restarts run to their end."""
    for _ in range(100):
        await asyncio.sleep(0)
        if not backend._restarting:
            return


def test_a_sync_does_not_wait_for_a_member_that_died_since_the_last_probe():
    async def scenario():
        backend, members = replica_backend(2)
        await backend.sync_weights([], 1, "keep")
        members[1].dead = True  # nobody has looked since
        members[1].restart_gate = asyncio.Event()  # its restart takes "long"
        await asyncio.wait_for(backend.sync_weights([], 2, "keep"), 5)
        assert [m.synced for m in members] == [[1, 2], [1]]
        assert [c.up for c in backend.client.counts] == [True, False]
        members[1].restart_gate.set()
        await settle(backend)
        assert await backend.revive() is True
        await backend.sync_weights([], 2, "keep")
        assert [m.synced for m in members] == [[1, 2, 2], [1, 2]]
        assert [c.up for c in backend.client.counts] == [True, True]

    asyncio.run(scenario())


def test_a_member_silent_during_a_sync_is_skipped_then_caught_up():
    async def scenario():
        backend, members = replica_backend(2)
        members[0].client.answers = False  # alive, but its health check fails now
        await backend.sync_weights([], 1, "keep")
        assert [m.synced for m in members] == [[], [1]]
        await settle(backend)  # nothing to restart
        assert backend.restarts == 0
        assert not backend.client.counts[0].up  # it holds the weights before version 1
        members[0].client.answers = True
        assert await backend.revive() is True
        await backend.sync_weights([], 1, "keep")
        assert members[0].synced == [1] and backend.client.counts[0].up

    asyncio.run(scenario())


def test_a_member_that_cannot_be_restarted_ends_the_run():
    async def scenario():
        backend, members = replica_backend(2)
        members[1].dead = members[1].cannot_restart = True
        await backend.revive()
        await asyncio.sleep(0)
        with pytest.raises(EngineDied, match="engine replica 1: the engine could not be"):
            await backend.revive()
        with pytest.raises(EngineDied):
            await backend.sync_weights([], 1, "keep")

    asyncio.run(scenario())


def test_the_watcher_takes_a_silent_member_out_of_use_and_back():
    async def scenario():
        backend, members = replica_backend(2, period=0.01)
        await backend.wait_ready()
        members[1].client.answers = False  # alive, not answering: nothing to restart
        await asyncio.sleep(0.1)
        assert not backend.client.counts[1].up
        assert not await backend.healthy()
        assert backend.restarts == 0
        members[1].client.answers = True
        await asyncio.sleep(0.1)
        assert backend.client.counts[1].up
        assert await backend.healthy()
        await backend.close()

    asyncio.run(scenario())
