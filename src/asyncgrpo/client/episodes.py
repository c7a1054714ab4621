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

    async def open_episode(self, max_turns: int | None = None) -> dict:
        """A new episode: `episode_id`, `base_path` (`/e/{id}/v1`), `api_key`, `model`."""
        body = {} if max_turns is None else {"max_turns": max_turns}
        return await self._json("POST", "/episodes", json=body, admin=True)

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
        return await self._json("POST", f"/episodes/{episode_id}/close", json=body, admin=True)

    async def episode_info(self, episode_id: str) -> dict:
        """An open episode's state: turns, refused_turns, deduped_retries, tool calls, ..."""
        return await self._json("GET", f"/episodes/{episode_id}", admin=True)

    async def episode_stats(self) -> dict:
        """Counts of the gateway: open, opened, closed, expired, refused."""
        return await self._json("GET", "/episodes", admin=True)
