"""The episode gateway's admin routes, as methods `EngineClient` inherits.

Agent episodes are a separate concern from generation and weight updates (only
the agent runner uses them), so they live here; call them on an `EngineClient`.
"""

from __future__ import annotations

from typing import Any


class EpisodeGatewayMixin:
    """Open, inspect and close episodes; needs the host class's `_json(method, path, **kw)`."""

    async def _json(self, method: str, path: str, **kw) -> Any:  # pragma: no cover
        raise NotImplementedError

    gateway: Any = None
    """A client of the server that hosts the episode gateway, when it is not this one (a
    vLLM engine's gateway is an asyncgrpo server of its own); None: this client's server."""

    def _episodes(self) -> Any:
        return self if self.gateway is None else self.gateway

    async def open_episode(self, max_turns: int | None = None) -> dict:
        """A new episode: `episode_id`, `base_url` (the agent's OpenAI base URL, ending in
        `base_path`, `/e/{id}/v1`), `api_key`, `model`."""
        body = {} if max_turns is None else {"max_turns": max_turns}
        gateway = self._episodes()
        opened = await gateway._json("POST", "/episodes", json=body, admin=True)
        opened["base_url"] = gateway.base_url + opened["base_path"]
        return opened

    async def close_episode(
        self,
        episode_id: str,
        reward: float | None,
        stop_reason: str = "ok",
        tool_failures: int = 0,
    ) -> dict:
        """Close an episode; its `samples` (input_ids, loss_mask, logprobs, versions) and metrics.

        Not idempotent: if the answer is lost, a retry is refused (409) and the
        samples are gone (the caller should treat that as an infrastructure error).
        """
        body = {"reward": reward, "stop_reason": stop_reason, "tool_failures": tool_failures}
        path = f"/episodes/{episode_id}/close"
        return await self._episodes()._json("POST", path, json=body, admin=True)

    async def episode_info(self, episode_id: str) -> dict:
        """An open episode's state: turns, refused_turns, deduped_retries, tool calls, ..."""
        return await self._episodes()._json("GET", f"/episodes/{episode_id}", admin=True)

    async def episode_stats(self) -> dict:
        """Counts of the gateway: open, opened, closed, expired, refused."""
        return await self._episodes()._json("GET", "/episodes", admin=True)
