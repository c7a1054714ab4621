"""The child processes of a process, read from /proc: for tests that check a run or a
server leaves no process behind, or that kill one of its children."""

from __future__ import annotations

from asyncgrpo.testing import child_pids as children

__all__ = ["children"]
