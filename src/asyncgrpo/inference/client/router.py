"""One client over several engine replicas: least outstanding work, episode affinity.

With `engine.replicas` > 1 the group builders get a `RoutedClient` instead of
an `EngineClient`. It offers the calls they make (`complete`, `chat`, the
episode routes, `server_info`, `health`) and sends each to one replica's own
client:

- new work (a generation request, a new episode) goes to the replica with the
  least outstanding work, counted in sequences: `n` for each request in flight,
  1 for each open episode; ties go round-robin;
- every call of an episode goes to the replica that opened it: `open_episode`
  returns that replica's absolute `base_url` (the agent's OpenAI client talks to
  it directly), `close_episode` and `episode_info` look the replica up by id;
- a replica marked down (`set_up`, done by `backend.replicas.ReplicaBackend`
  while it restarts or fails its health check) gets no new work while another
  is up. Work already sent to it waits in its client's retries.

Why not vLLM's router. `vllm-router` (PyPI 0.1.17, a Rust proxy; its source at
github.com/vllm-project/router was read: `src/server.rs`, `src/routers/http/router.rs`,
`src/policies/hash_key.rs`) picks one worker per request. Its session affinity
keys on headers (`x-session-id`, ...) or body fields (`user`, `session_id`),
else on a hash of the body; a path it does not know, like our gateway's
`/e/{episode}/v1/chat/completions`, goes through a transparent proxy that also
picks a worker by policy. An agent's plain OpenAI client sends none of those
keys and the episode id is in the path, so one episode's turns would be spread
over replicas while its state lives in one replica's gateway. A weight sync
must pause, update and resume each replica, so the trainer calls the replicas
directly anyway, and would keep a second view of their health beside the
router's. Its load-aware policies had open bug reports when read: `power_of_two`
polls `/get_load`, which vLLM does not serve (vllm-project/router#174), and ignores the
router's own in-flight counts (#177); the periodic health check resets the
per-worker load counters (#197). And it is one more process to supervise.
Balancing here takes no process and counts outstanding work exactly.

One event loop uses a client (the rollout loop): choosing a replica and
counting the work on it happen with no await in between.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from asyncgrpo.base.engine_errors import EngineRefused


@dataclass
class ReplicaCounts:
    """What one replica was given, for tests and metrics."""

    requests: int = 0
    """Generation requests sent to it."""
    sequences: int = 0
    """Sequences those requests asked for (`n` each)."""
    episodes: int = 0
    """Agent episodes opened on it."""
    outstanding: int = 0
    """Sequences in flight on it now, plus its open episodes."""
    up: bool = True
    """False while it is known to be down (it then gets no new work)."""


class RoutedClient:
    """The builders' client when the engine has several replicas (see the module doc)."""

    def __init__(self, clients: Sequence[Any]):
        if not clients:
            raise ValueError("RoutedClient needs at least one replica client")
        self.clients = list(clients)
        self.counts = [ReplicaCounts() for _ in self.clients]
        self._turn = 0  # where the round-robin among equally loaded replicas starts
        self._episode_replica: dict[str, int] = {}

    @property
    def base_urls(self) -> list[str]:
        return [c.base_url for c in self.clients]

    def set_up(self, replica: int, up: bool) -> None:
        """Mark `replica` up (it may get new work) or down."""
        self.counts[replica].up = up

    def stats(self) -> list[dict]:
        """Per replica: its counts and base URL."""
        return [
            {"replica": i, "base_url": c.base_url, **asdict(counts)}
            for i, (c, counts) in enumerate(zip(self.clients, self.counts, strict=True))
        ]

    def pick(self) -> int:
        """The replica for new work: least outstanding among those up (among all when none
        is), the first at or after the round-robin turn among equals."""
        candidates = [i for i, c in enumerate(self.counts) if c.up] or range(len(self.counts))
        least = min(self.counts[i].outstanding for i in candidates)
        tied = [i for i in candidates if self.counts[i].outstanding == least]
        choice = min(tied, key=lambda i: (i - self._turn) % len(self.clients))
        self._turn = (choice + 1) % len(self.clients)
        return choice

    @contextmanager
    def _outstanding(self, replica: int, amount: int) -> Iterator[None]:
        self.counts[replica].outstanding += amount
        try:
            yield
        finally:
            self.counts[replica].outstanding -= amount

    # ---- generation ------------------------------------------------------------------

    async def complete(self, prompt_ids: list[int], *, n: int = 1, **kw: Any):
        """`EngineClient.complete` on the least loaded replica."""
        return await self._generate("complete", prompt_ids, n, kw)

    async def chat(self, messages: list[dict], *, n: int = 1, **kw: Any):
        """`EngineClient.chat` on the least loaded replica."""
        return await self._generate("chat", messages, n, kw)

    async def _generate(self, method: str, prompt: Any, n: int, kw: dict) -> Any:
        replica = self.pick()
        counts = self.counts[replica]
        counts.requests += 1
        counts.sequences += n
        with self._outstanding(replica, n):
            return await getattr(self.clients[replica], method)(prompt, n=n, **kw)

    # ---- episodes --------------------------------------------------------------------

    async def open_episode(self, max_turns: int | None = None) -> dict:
        """A new episode on the least loaded replica; its `base_url` is that replica's."""
        replica = self.pick()
        self.counts[replica].outstanding += 1  # counted before the await: concurrent opens spread
        try:
            opened = await self.clients[replica].open_episode(max_turns=max_turns)
        except BaseException:
            self.counts[replica].outstanding -= 1
            raise
        self.counts[replica].episodes += 1
        self._episode_replica[opened["episode_id"]] = replica
        return opened

    async def close_episode(
        self, episode_id: str, reward: float | None, stop_reason: str = "ok", tool_failures: int = 0
    ) -> dict:
        """Close the episode on the replica that opened it (forgotten here even if this fails,
        as the server forgets it: a second close is refused)."""
        replica = self._replica_of(episode_id)
        del self._episode_replica[episode_id]
        try:
            return await self.clients[replica].close_episode(
                episode_id, reward, stop_reason, tool_failures
            )
        finally:  # the episode's unit of outstanding work ends with this call
            self.counts[replica].outstanding -= 1

    async def episode_info(self, episode_id: str) -> dict:
        return await self.clients[self._replica_of(episode_id)].episode_info(episode_id)

    async def episode_stats(self) -> dict:
        """The gateways' counts summed over the replicas that are up, and each one's."""
        answers = await self._ask_live("episode_stats")
        return {**_summed(list(answers.values())), "replicas": answers}

    def _replica_of(self, episode_id: str) -> int:
        try:
            return self._episode_replica[episode_id]
        except KeyError:
            raise EngineRefused(
                404, f"episode {episode_id!r} is not open (not opened here, or closed)"
            ) from None

    # ---- information -------------------------------------------------------------------

    async def server_info(self) -> dict:
        """The first live replica's info, with `stats` combined over the live replicas and
        each one's info under `replicas`."""
        infos = await self._ask_live("server_info")
        first = infos[min(infos)]
        stats = _summed([info.get("stats") or {} for info in infos.values()])
        return {**first, "stats": stats, "replicas": infos}

    async def models(self) -> list[dict]:
        live = [i for i, c in enumerate(self.counts) if c.up] or [0]
        return await self.clients[live[0]].models()

    async def health(self) -> bool:
        """True when any replica answers its health check (work can be served)."""
        return any(await asyncio.gather(*(c.health() for c in self.clients)))

    async def _ask_live(self, method: str) -> dict[int, Any]:
        """`method()` of every replica that is up (of all when none is), by replica."""
        live = [i for i, c in enumerate(self.counts) if c.up] or list(range(len(self.clients)))
        answers = await asyncio.gather(*(getattr(self.clients[i], method)() for i in live))
        return dict(zip(live, answers, strict=True))


def _summed(dicts: list[dict]) -> dict:
    """Numbers summed key by key, except `weight_version`: the oldest one any replica holds."""
    out: dict[str, Any] = {}
    for d in dicts:
        for key, value in d.items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            if key not in out:
                out[key] = value
            elif key == "weight_version":
                out[key] = min(out[key], value)
            else:
                out[key] += value
    return out
