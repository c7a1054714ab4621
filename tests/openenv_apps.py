"""OpenEnv servers that misbehave, for the OpenEnv adapter's tests (built on the example).

- `flaky_app`: the guess-the-number server, except that it drops the WebSocket of the
  first `OPENENV_DROPS` (default 1) episodes at their message number `OPENENV_DROP_AT`
  counted from their `reset` (1: the reset itself, 2: the first step; default 2), as a
  crashed or restarted server would. Sessions that never reset (the adapter's concurrency
  probe) are left alone.
- `narrow_app`: the same environment allowing 2 sessions at once.
- `faulty_app`: `step` raises for the number 13 (an EXECUTION_ERROR) and sleeps 3 s for
  the number 14 (no answer in time).

Importable from the repository root (`tests.openenv_apps:flaky_app`, served by a run) and
from the tests' own path (`openenv_apps`).
"""

from __future__ import annotations

import json
import os
import time

from openenv.core.env_server import create_app

from examples.openenv_guess import GuessAction, GuessEnvironment, GuessObservation


class DropSessions:
    """ASGI middleware: closes the chosen sessions' sockets mid-episode (see the docstring)."""

    def __init__(self, app, drops: int, at_message: int):
        self.app = app
        self.drops_left = drops
        self.at_message = at_message

    async def __call__(self, scope, receive, send):
        if scope["type"] != "websocket":
            return await self.app(scope, receive, send)
        seen = None  # messages since this connection's reset; None before its reset
        dropped = False

        async def guarded_send(message):
            if not dropped:  # the app's own close or error after the drop goes nowhere
                await send(message)

        async def watched_receive():
            nonlocal seen, dropped
            message = await receive()
            if message["type"] != "websocket.receive":
                return message
            kind = json.loads(message.get("text") or "{}").get("type")
            if seen is None and kind == "reset" and self.drops_left > 0:
                self.drops_left -= 1
                seen = 0
            if seen is not None:
                seen += 1
                if seen == self.at_message:
                    await send({"type": "websocket.close", "code": 1011})
                    dropped = True
                    return {"type": "websocket.disconnect", "code": 1011}
            return message

        return await self.app(scope, watched_receive, guarded_send)


def guess_app(max_sessions: int = 64):
    return create_app(
        GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=max_sessions
    )


class FaultyEnvironment(GuessEnvironment):
    def step(self, action, timeout_s=None, **kwargs):
        if action.number == 13:
            raise RuntimeError("the environment broke")
        if action.number == 14:
            time.sleep(3)
        return super().step(action, timeout_s, **kwargs)


def make_flaky_app():
    drops = int(os.environ.get("OPENENV_DROPS", "1"))
    return DropSessions(guess_app(), drops, int(os.environ.get("OPENENV_DROP_AT", "2")))


flaky_app = make_flaky_app()
narrow_app = guess_app(max_sessions=2)
faulty_app = create_app(FaultyEnvironment, GuessAction, GuessObservation, max_concurrent_envs=8)
