"""Arithmetic too large to do in the head, with a calculator tool: the agent recipe's task.

"What is 347 * 58?" — a 3-digit by 2-digit product (or a sum of four 3-4 digit
numbers) that a 135M model almost never gets right on its own, but can get
right by calling `calculator("347 * 58")` and copying the result. The rollout
is the plain OpenAI-client loop of `examples/calculator_agent.py`; this module
holds what it needs: the rows, the tool and the grading.

The tool evaluates untrusted text, so it never calls `eval`: the expression is
parsed with `ast` and only numbers, + - * / and parentheses are walked; anything
else (names, calls, attributes, `**`) is refused with a message the model reads.
"""

from __future__ import annotations

import ast
import operator
import random

from asyncgrpo.learning.tasks._common import completion_text, integers, user_prompt

_TEMPLATES = {
    "multiply": "What is {a} * {b}? Use the calculator tool, then state the final answer.",
    "sum": "What is {terms}? Use the calculator tool, then state the final answer.",
}
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**15


def calculator_rows(count: int, seed: int, kind: str = "multiply") -> list[dict]:
    """`count` distinct problems: `multiply` (3-digit × 2-digit), `sum` (four 3-4 digit
    numbers) or `mixed` (alternating); columns `prompt`, `answer`, `expression`."""
    if kind not in ("multiply", "sum", "mixed"):
        raise ValueError(f"kind must be 'multiply', 'sum' or 'mixed'; got {kind!r}")
    rng = random.Random(seed)
    rows, seen = [], set()
    attempts = 0
    while len(rows) < count and attempts < 20 * count:
        attempts += 1
        this = kind if kind != "mixed" else ("multiply", "sum")[len(rows) % 2]
        if this == "multiply":
            a, b = rng.randint(100, 999), rng.randint(11, 99)
            expression, text = f"{a} * {b}", _TEMPLATES[this].format(a=a, b=b)
        else:
            terms = [rng.randint(100, 9999) for _ in range(4)]
            expression = " + ".join(map(str, terms))
            text = _TEMPLATES[this].format(terms=expression)
        if expression in seen:
            continue
        seen.add(expression)
        rows.append(
            {
                "prompt": user_prompt(text),
                "answer": str(calculate(expression)),
                "expression": expression,
                "task": "calculator",
            }
        )
    return rows


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression (numbers, + - * /, parentheses); ValueError else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.replace("×", "*"), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if abs(node.value) > MAX_MAGNITUDE:
            raise ValueError("number too large")
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        value = _BINARY[type(node.op)](left, right)
        if abs(value) > MAX_MAGNITUDE:
            raise ValueError("result too large")
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    what = type(node.op if isinstance(node, ast.BinOp | ast.UnaryOp) else node).__name__
    raise ValueError(f"only numbers, + - * / and parentheses are allowed (found {what})")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: numbers combined with + - * / and parentheses, e.g. "347 * 58".
    """
    value = calculate(expression)
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def contains_answer(text: str, answer: str) -> bool:
    """The right number appears in `text` (thousands separators allowed)."""
    return int(answer) in integers(text)


def calculator_answer_reward(prompts, completions, completion_ids=None, *, answer, **columns):
    """1.0 when a plain completion contains the right number, else 0.0 (no tool: the base rate
    of answering in the head)."""
    return [
        1.0 if contains_answer(completion_text(c), a) else 0.0
        for c, a in zip(completions, answer, strict=True)
    ]
