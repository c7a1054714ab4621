"""Short arithmetic with a strict answer format: "What is 3 + 4? Reply with only the number."

Built for the CPU demo: prompts are one short line and a right answer is one or
two tokens, so a GRPO step over 32 completions costs seconds, not minutes.
Two rewards separate the skills: `arithmetic_reward` grades the answer (full
credit for the bare number, half credit when the right number ends a longer
reply such as "3 + 4 = 7"), and `number_only_reward` grades the format alone.
SmolLM2-135M-Instruct mostly answers correctly but verbosely, so the format is
what GRPO teaches first (base rates: benchmarks/base_rate.py).
"""

from __future__ import annotations

import itertools
import random

from asyncgrpo.learning.tasks._common import completion_text, integers, user_prompt, words

_TEMPLATES = (
    "What is {a} {op} {b}? Reply with only the number.",
    "Compute {a} {op} {b}. Answer with only the number.",
    "{a} {op} {b} = ? Give only the number.",
)
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_rows(
    count: int, seed: int, max_operand: int = 9, ops: str = "+", templates: int = 1
) -> list[dict]:
    """Up to `count` distinct problems `a op b` with 0 <= a, b <= max_operand, in a seeded order.

    `ops` is a string of operators from "+-*" (subtraction keeps a >= b, so answers are
    never negative); `templates` is how many phrasings to use (1..3). Fewer rows come
    back when the space of distinct problems is smaller than `count`.
    """
    if not ops or any(op not in _OPS for op in ops):
        raise ValueError(f"ops must be made of '+', '-', '*'; got {ops!r}")
    if not 1 <= templates <= len(_TEMPLATES):
        raise ValueError(f"templates must be between 1 and {len(_TEMPLATES)}; got {templates}")
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1; got {max_operand}")
    space = [
        (a, op, b, t)
        for a, b in itertools.product(range(max_operand + 1), repeat=2)
        for op in ops
        for t in range(templates)
        if not (op == "-" and a < b)
    ]
    random.Random(seed).shuffle(space)
    return [
        {
            "prompt": user_prompt(_TEMPLATES[t].format(a=a, op=op, b=b)),
            "answer": str(_OPS[op](a, b)),
            "task": "arithmetic",
        }
        for a, op, b, t in space[:count]
    ]


def _bare_number(text: str) -> str | None:
    """The integer when `text` is only an integer (whitespace and a final period allowed)."""
    stripped = text.strip().rstrip(".").strip()
    if stripped.lstrip("-").isdigit():
        return str(int(stripped))
    return None


def arithmetic_reward(prompts, completions, completion_ids=None, *, answer, **columns):
    """1.0: the reply is just the right number; 0.5: the right number ends a longer reply
    ("3 + 4 = 7"); 0.0 otherwise (wrong, no number, or the number not last)."""
    scores = []
    for completion, expected in zip(completions, answer, strict=True):
        text = completion_text(completion)
        if _bare_number(text) == str(int(expected)):
            scores.append(1.0)
        else:
            found = integers(text)
            scores.append(0.5 if found and found[-1] == int(expected) else 0.0)
    return scores


def short_arithmetic_reward(prompts, completions, completion_ids=None, *, answer, **columns):
    """Correctness with a brevity gradient: when the last number of the reply is the answer,
    1.0 minus 0.1 per word beyond the first (floor 0.2): "7" -> 1.0, "3 + 4 = 7" -> 0.8,
    "The answer is 7." -> 0.7; a wrong or missing answer -> 0.0. Denser than
    `arithmetic_reward`, whose full credit (a bare number) the base model almost never
    samples."""
    scores = []
    for completion, expected in zip(completions, answer, strict=True):
        text = completion_text(completion)
        found = integers(text)
        if not found or found[-1] != int(expected):
            scores.append(0.0)
        else:
            scores.append(max(0.2, 1.0 - 0.1 * (len(words(text)) - 1)))
    return scores


def number_only_reward(prompts, completions, completion_ids=None, **columns):
    """1.0 when the reply is only an integer (right or wrong), else 0.0: the format alone."""
    return [1.0 if _bare_number(completion_text(c)) is not None else 0.0 for c in completions]
