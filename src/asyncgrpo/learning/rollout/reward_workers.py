"""Where plain reward functions run: daemon threads, or worker processes that can be killed.

A reward function is user code, and user code hangs (a verifier waiting on a
lock, a regex that backtracks forever), crashes (a segfault in a C extension)
or eats memory. `RewardRunner` gives every call a deadline; the pool decides
what a call that misses it costs (`rollout.reward_workers`):

- `ThreadWorkers` (`thread`): each call on a fresh daemon thread, at most
  `size` at once. A thread cannot be stopped, so a stuck call keeps its slot
  until it returns; once every slot is stuck, later calls fail after waiting
  their deadline for a free one, with a message naming the stuck functions.
  Daemon threads are never joined at exit. That is why this is not a
  `ThreadPoolExecutor`: its exit hook joins every worker thread, a stuck one
  too, and the process never exits.
- `ProcessWorkers` (`process`): up to `size` worker processes, each running
  one call at a time. A call past its deadline gets its worker killed
  (SIGKILL); the next call starts a fresh one. A worker that dies (segfault,
  the OOM killer) fails only its own call. A worker is a fresh interpreter
  running this module (not `multiprocessing`, whose spawn re-runs the user's
  main script in every worker, training included when it is unguarded); it
  receives the functions pickled, by reference, and imports their modules.
  Workers exit with the trainer, even after a SIGKILL of it.

A call waits at most its deadline for a free worker, then has its deadline to
return. `async def` functions run on the rollout loop (`run_on_loop`) and are
cancelled at theirs. `RunningCalls` records what runs right now, for the
watchdog.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

POLL_S = 0.01  # how often a call waiting for a free worker looks again
WORKER_START_TIMEOUT_S = 120.0  # spawning a worker and importing the functions' modules


class CallTimedOut(Exception):
    """The call missed its deadline; the message says what it was waiting for."""


class WorkerCrashed(Exception):
    """The worker process running the call died, or never started."""


class RunningCalls:
    """Reward calls executing now (thread-safe): which function, since when."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[int, tuple[str, float]] = {}
        self._keys = itertools.count()

    def begin(self, name: str) -> int:
        with self._lock:
            key = next(self._keys)
            self._calls[key] = (name, time.monotonic())
        return key

    def end(self, key: int) -> None:
        with self._lock:
            self._calls.pop(key, None)

    def ages(self) -> list[tuple[str, float]]:
        """(function name, seconds running) of every call, oldest first."""
        now = time.monotonic()
        with self._lock:
            calls = sorted(self._calls.values(), key=lambda call: call[1])
        return [(name, now - started) for name, started in calls]

    def describe(self) -> str:
        """`'f' 75 s, 'g' 2 s`, or `none`."""
        return ", ".join(f"'{name}' {age:.0f} s" for name, age in self.ages()) or "none"


async def await_within(future: asyncio.Future, timeout_s: float) -> Any:
    """The future's result, or `CallTimedOut` after `timeout_s` (the future is cancelled)."""
    try:
        done, _ = await asyncio.wait({future}, timeout=timeout_s)
    except asyncio.CancelledError:
        future.cancel()
        raise
    if not done:
        future.cancel()
        raise CallTimedOut(f"did not return within {timeout_s:g} s")
    return future.result()


async def run_on_loop(
    name: str, awaitable: Awaitable, timeout_s: float, running: RunningCalls
) -> Any:
    """Await an async reward function's result on this loop, cancelled at `timeout_s`."""
    key = running.begin(name)
    try:
        return await await_within(asyncio.ensure_future(awaitable), timeout_s)
    finally:
        running.end(key)


class ThreadWorkers:
    """Sync functions on daemon threads, at most `size` at once (see the module docstring)."""

    def __init__(
        self,
        funcs: Sequence[Callable | None],
        names: Sequence[str],
        size: int,
        running: RunningCalls,
    ):
        self.funcs, self.names, self.size, self.running = funcs, names, size, running
        self._slots = threading.BoundedSemaphore(size)  # released by the thread, when it ends

    async def run(self, index: int, kwargs: dict, timeout_s: float) -> Any:
        await self._acquire(timeout_s)
        future: concurrent.futures.Future = concurrent.futures.Future()
        threading.Thread(
            target=self._work,
            args=(index, kwargs, future),
            name=f"reward-{self.names[index]}",
            daemon=True,
        ).start()
        return await await_within(asyncio.wrap_future(future), timeout_s)

    async def _acquire(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._slots.acquire(blocking=False):
            if time.monotonic() >= deadline:
                raise CallTimedOut(
                    f"found no free reward thread within {timeout_s:g} s: all {self.size} are "
                    f"busy ({self.running.describe()}); a thread cannot be stopped, "
                    "`rollout.reward_workers: process` kills a stuck call"
                )
            await asyncio.sleep(POLL_S)

    def _work(self, index: int, kwargs: dict, future: concurrent.futures.Future) -> None:
        key = self.running.begin(self.names[index])
        try:
            if future.set_running_or_notify_cancel():
                try:
                    result = self.funcs[index](**kwargs)
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
        finally:
            self.running.end(key)
            self._slots.release()

    def close(self) -> None:
        """Nothing to wait for: a stuck daemon thread dies with the process."""


class ProcessWorkers:
    """Sync functions in killable worker processes (see the module docstring)."""

    def __init__(
        self,
        funcs: Sequence[Callable | None],
        names: Sequence[str],
        size: int,
        running: RunningCalls,
    ):
        self.names, self.size, self.running = names, size, running
        self._payload = pickle.dumps((sys.path, pickle.dumps(list(funcs))))
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()

    async def run(self, index: int, kwargs: dict, timeout_s: float) -> Any:
        worker = await self._take(timeout_s)
        key = self.running.begin(self.names[index])
        try:
            status, value = await worker.call(index, kwargs, timeout_s)
        except BaseException:  # timed out, died, or cancelled at shutdown: never reused
            self._discard(worker)
            raise
        finally:
            self.running.end(key)
        self._idle.append(worker)
        if status == "error":
            raise value
        return value

    async def _take(self, timeout_s: float) -> _Worker:
        """An idle worker, or a new one while fewer than `size` exist."""
        deadline = time.monotonic() + timeout_s
        while not self._idle:
            if len(self._all) < self.size:
                worker = _Worker(self._payload)
                self._all.add(worker)
                try:
                    await worker.wait_ready(WORKER_START_TIMEOUT_S)
                except BaseException:
                    self._discard(worker)
                    raise
                return worker
            if time.monotonic() >= deadline:
                raise CallTimedOut(
                    f"found no free reward worker within {timeout_s:g} s: all {self.size} "
                    f"are busy ({self.running.describe()})"
                )
            await asyncio.sleep(POLL_S)
        return self._idle.pop()

    def _discard(self, worker: _Worker) -> None:
        self._all.discard(worker)
        worker.kill()

    def close(self) -> None:
        """Kill every worker, busy or not: none holds state worth waiting for."""
        for worker in list(self._all):
            self._discard(worker)
        self._idle.clear()


class _Worker:
    """One worker process and the socket to it."""

    def __init__(self, payload: bytes):
        ours, theirs = socket.socketpair()
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno())], pass_fds=[theirs.fileno()]
            )
        self.conn = Connection(ours.detach())
        self.conn.send_bytes(payload)  # the parent's sys.path, then the pickled functions

    async def wait_ready(self, timeout_s: float) -> None:
        try:
            status = await self._receive(timeout_s)
        except CallTimedOut:
            raise WorkerCrashed(f"a reward worker did not start within {timeout_s:g} s") from None
        if status != "ready":
            raise WorkerCrashed(f"a reward worker could not load the functions: {status[1]}")

    async def call(self, index: int, kwargs: dict, timeout_s: float) -> tuple[str, Any]:
        try:
            self.conn.send((index, kwargs))
        except OSError:
            raise WorkerCrashed(self._exit_status()) from None
        return await self._receive(timeout_s)

    async def _receive(self, timeout_s: float) -> Any:
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        fd = self.conn.fileno()
        loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        try:
            await await_within(readable, timeout_s)
        finally:
            loop.remove_reader(fd)
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            raise WorkerCrashed(self._exit_status()) from None

    def _exit_status(self) -> str:
        try:
            code = self.process.wait(1)
        except subprocess.TimeoutExpired:
            code = None
        how = f"signal {signal.Signals(-code).name}" if code and code < 0 else f"code {code}"
        return f"its worker process {self.process.pid} exited with {how}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)
        self.conn.close()


def _serve(fd: int) -> None:
    """A worker process: run calls from the socket `fd` until it closes, one at a time."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's; it closes us
    _exit_with_parent()
    conn = Connection(fd)
    path, payload = pickle.loads(conn.recv_bytes())
    sys.path[:] = path  # the functions' modules are found where the trainer found them
    try:
        funcs = pickle.loads(payload)
    except Exception as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send("ready")
    while True:
        try:
            index, kwargs = conn.recv()
        except EOFError:
            return
        try:
            reply = ("ok", funcs[index](**kwargs))
        except BaseException as exc:
            reply = ("error", _sendable(exc))
        try:
            conn.send(reply)
        except Exception as exc:  # the result cannot be pickled
            conn.send(("error", TypeError(f"returned a value that cannot be sent back: {exc}")))


def _sendable(exc: BaseException) -> BaseException:
    """`exc` with its traceback as a note, or a RuntimeError like it if it cannot be pickled."""
    note = "in the reward worker process:\n" + "".join(traceback.format_exception(exc))
    try:
        pickle.loads(pickle.dumps(exc))  # some exception classes pickle but do not unpickle
    except Exception:
        exc = RuntimeError(f"{type(exc).__name__}: {exc}")
    exc.add_note(note)
    return exc


def _exit_with_parent(period_s: float = 1.0) -> None:
    """Exit when the trainer is gone (a SIGKILL of it runs no clean-up that could kill us)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
