"""`engine.replicas: N`: several engines of one type behind one `EngineBackend`.

Each member is a full backend (`EmbeddedBackend`, `VLLMBackend`) that starts,
watches and restarts its own engine and repeats a sync the engine's death
interrupted. This class adds what only the set needs:

- routing: `client` is a `client.router.RoutedClient` over the members'
  clients (least outstanding work, episode affinity);
- weight syncs go to every member at once, each tried once: a member that dies
  or stalls in its sync is restarted in the background and skipped (the run
  lands syncs while the trainer steps, `run/session/engine_link.py`, so a death can
  come in any sync), and only a member that cannot come back ends the run;
- a health watcher on the rollout loop probes every member each
  `health_period_s` (and so do `revive` and `sync_weights`). A member that
  fails is taken out of routing and restarted in the background at once, so
  the others keep generating and the trainer keeps stepping;
- a member gets new work only while it holds the weights of the last sync.
  One that restarted (its restart count moved) or was skipped by a sync (it
  was restarting) does not; once it answers again, `revive` returns True and
  the run re-sends the current weights to all (a keep-pause for the others).

Departure from one engine: there, `revive` restarts the engine while the
trainer waits; here a restart never holds up the trainer, a sync or the other
replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Iterable, Sequence

from asyncgrpo.base.engine_errors import EngineDied
from asyncgrpo.inference.backend.base import EngineBackend, NamedTensors
from asyncgrpo.inference.client.router import RoutedClient

logger = logging.getLogger(__name__)

HEALTH_PERIOD_S = 1.0  # how often the watcher probes every member
PROBE_TIMEOUT_S = 10.0  # a member's health check that takes longer counts as failed
CLOSE_WAIT_S = 10.0  # how long `close` lets a restart in progress finish before stopping it


class ReplicaBackend:
    """`members`, each a full `EngineBackend`, sampling for one run."""

    def __init__(
        self, members: Sequence[EngineBackend], *, health_period_s: float = HEALTH_PERIOD_S
    ):
        if not members:
            raise ValueError("ReplicaBackend needs at least one member backend")
        self.members = list(members)
        for member in self.members:  # one that fails its sync restarts in the background
            member.sync_attempts = 1
        self.client = RoutedClient([m.client for m in self.members])
        self.health_period_s = health_period_s
        self._healthy = [True] * len(self.members)
        self.sync_timings: dict[str, float] = {}  # the slowest member's, step by step
        self._version: int | None = None  # of the last sync
        self._held: list[int | None] = [None] * len(self.members)  # each one's last version
        self._synced_restarts = [m.restarts for m in self.members]  # at each one's last sync
        self._restarting: dict[int, asyncio.Task] = {}
        self._failure: EngineDied | None = None  # a member that could not be restarted
        self._watcher: asyncio.Task | None = None

    @property
    def restarts(self) -> int:
        return sum(m.restarts for m in self.members)

    @property
    def base_urls(self) -> list[str]:
        return [url for m in self.members for url in m.base_urls]

    def launch(self) -> None:
        for member in self.members:
            member.launch()

    async def wait_ready(self, layout: NamedTensors | None = None) -> None:
        await _all(m.wait_ready(layout) for m in self.members)
        if self._watcher is None:
            self._watcher = asyncio.create_task(self._watch())

    async def healthy(self) -> bool:
        """True when every replica answers."""
        return all(await asyncio.gather(*(_probe(m) for m in self.members)))

    async def revive(self) -> bool:
        """True when a member that is not restarting lacks the last sync's weights (it was
        restarted, or skipped): send them again. Starts the restart of any member that
        fails its health check now."""
        await self._check_members()
        if self._failure is not None:
            raise self._failure
        return any(i not in self._restarting and not self._has_weights(i) for i in self._ids())

    async def sync_weights(self, weights: NamedTensors, version: int, mode: str) -> None:
        """The sync on every member at once, but those restarting: a member that died
        since the last probe restarts in the background instead of holding this up."""
        await self._check_members()
        if self._failure is not None:
            raise self._failure
        ready = [i for i in self._ids() if i not in self._restarting]
        syncs = (self._sync_member(i, weights, version, mode) for i in ready)
        results = await asyncio.gather(*syncs, return_exceptions=True)
        self._version = version  # with what each member holds, before anything awaits
        for i, result in zip(ready, results, strict=True):
            if result is True:
                self._held[i], self._synced_restarts[i] = version, self.members[i].restarts
        for i in self._ids():
            self._route(i)
        self.sync_timings = _slowest([self.members[i].sync_timings for i in ready])
        _raise_first(results)

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        restarts = list(self._restarting.values())
        if restarts:  # a member stopped mid-restart could start its engine after its close
            await asyncio.wait(restarts, timeout=CLOSE_WAIT_S)
            for task in restarts:
                task.cancel()
            await asyncio.gather(*restarts, return_exceptions=True)
        await _all(m.close() for m in self.members)

    # ---- inside ---------------------------------------------------------------------

    async def _sync_member(self, i: int, weights: NamedTensors, version: int, mode: str) -> bool:
        """True when member `i` holds the weights; one that died or stalled in its sync is
        restarted in the background instead (`revive` then has the weights re-sent)."""
        try:
            await self.members[i].sync_weights(weights, version, mode)
        except EngineDied as exc:
            logger.warning("engine replica %d: %s; restarting it in the background", i, exc)
            if i not in self._restarting:
                self._restarting[i] = asyncio.create_task(self._restart(i))
            return False
        return True

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.health_period_s)
            try:
                await self._check_members()
            except Exception:  # a failing probe must not end the watching
                logger.exception("checking the engine replicas failed")

    async def _check_members(self) -> None:
        """Probe every member; route by the answers; restart the ones that failed."""
        answers = await asyncio.gather(*(_probe(m) for m in self.members))
        for i, healthy in enumerate(answers):
            self._healthy[i] = healthy
            if not healthy and i not in self._restarting:
                self._restarting[i] = asyncio.create_task(self._restart(i))
            self._route(i)

    async def _restart(self, i: int) -> None:
        """Bring member `i` back if it died (its `revive` says whether it had to)."""
        try:
            if await self.members[i].revive():
                logger.warning("engine replica %d was restarted", i)
        except EngineDied as exc:
            self._failure = EngineDied(f"engine replica {i}: {exc}")
        except Exception as exc:  # a member's own bug: it cannot come back either
            self._failure = EngineDied(f"engine replica {i} could not be restarted: {exc!r}")
        finally:
            del self._restarting[i]
            self._route(i)

    def _ids(self) -> range:
        return range(len(self.members))

    def _has_weights(self, i: int) -> bool:
        """Member `i` got the last sync's weights and has not restarted since."""
        restarted = self.members[i].restarts != self._synced_restarts[i]
        return self._held[i] == self._version and not restarted

    def _route(self, i: int) -> None:
        """Member `i` may get new work when it answers, is not restarting and holds the
        last sync's weights."""
        up = self._healthy[i] and i not in self._restarting and self._has_weights(i)
        if up != self.client.counts[i].up:
            logger.warning("engine replica %d is %s", i, "back in use" if up else "out of use")
        self.client.set_up(i, up)


async def _probe(member: EngineBackend) -> bool:
    """The member's health check, failed when it raises or takes over `PROBE_TIMEOUT_S`."""
    with contextlib.suppress(Exception):
        return bool(await asyncio.wait_for(member.healthy(), PROBE_TIMEOUT_S))
    return False


def _slowest(timings: list[dict[str, float]]) -> dict[str, float]:
    """Each step's longest time over the members."""
    return {k: max(t[k] for t in timings if k in t) for k in {k for t in timings for k in t}}


async def _all(calls: Iterable[Awaitable]) -> None:
    """Await `calls` together, each to its end; then raise the first failure."""
    _raise_first(await asyncio.gather(*calls, return_exceptions=True))


def _raise_first(results: list) -> None:
    """Raise the first failure among `results`, an `EngineDied` before any other."""
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise next((e for e in errors if isinstance(e, EngineDied)), errors[0])
