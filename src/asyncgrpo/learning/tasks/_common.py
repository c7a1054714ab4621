"""Helpers shared by the built-in tasks: completion text, numbers, words."""

from __future__ import annotations

import re
from typing import Any

_INT = re.compile(r"-?\d+")
_WORD = re.compile(r"[A-Za-z0-9']+")


def completion_text(completion: Any) -> str:
    """The text of a completion: a plain string, or TRL's conversational form
    `[{"role": "assistant", "content": text}]`."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content") or "")
    raise TypeError(f"a completion must be a string or a list of messages, got {completion!r}")


def integers(text: str) -> list[int]:
    """Every integer written in `text`, in order (`3 + 4 = 7` -> [3, 4, 7])."""
    return [int(m) for m in _INT.findall(text.replace(",", ""))]


def words(text: str) -> list[str]:
    """Words of `text`, lower-cased, punctuation dropped (`Cats sleep.` -> [cats, sleep])."""
    return [w.lower() for w in _WORD.findall(text)]


def user_prompt(content: str) -> list[dict]:
    """A one-message conversational prompt (no system message: the template's default,
    or none, keeps prompts short)."""
    return [{"role": "user", "content": content}]
