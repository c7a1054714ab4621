"""Prompts laid out as a tree, so the tokens several prompts share are computed once.

`packing.py` lays a micro-batch out in one packed row. The G completions of one prompt
always share it. Different prompts share prefixes too: a chat template's system prompt,
few-shot examples, an agent's tool descriptions and earlier turns. Here the batch's
distinct prompts form a radix tree (a trie whose edges are runs of tokens), and a run
that several prompts share becomes one segment of the row that each of them attends to,
its positions continuing where the run before it ended. By causality the log-probs and
gradients are those of the unshared sequences.

A shared run's own segment costs a few more attention calls per layer on a CPU
(`segments.py`) and saves its length once per extra prompt, so runs that save fewer than
`MIN_SAVED_ROWS` rows stay in each prompt's own segment. The G completions of a prompt always share it, as
before. Measured on the default recipe: its 38-token prompts share 25 (system prompt and
"Describe"), so a step of 4 prompts x 8 completions feeds 15% fewer rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# a shared run gets its own segment when it saves at least this many rows (length x
# (prompts sharing it - 1)): on a CPU each row costs ~6 forward-and-backward FLOPs per
# weight, a segment ~3 more sdpa calls per layer (~0.1 ms each)
MIN_SAVED_ROWS = 16

# append(tokens, first position, parent segment or None) -> (segment index, first row)
Append = Callable[[list[int], int, "int | None"], tuple[int, int]]


@dataclass
class _Node:
    tokens: list[int]  # this edge's run (empty at the root only)
    children: list[_Node] = field(default_factory=list)
    groups: list[list[int]] = field(default_factory=list)  # sequences whose prompt ends here

    @property
    def consumers(self) -> int:
        return len(self.children) + len(self.groups)


def prompt_tree(prompts: Sequence[Sequence[int]], groups: Sequence[list[int]]) -> _Node:
    """The radix tree of distinct `prompts`; `groups[j]` (sequence indices) end at prompt j."""
    root = _Node([])
    for prompt, members in zip(prompts, groups, strict=True):
        _insert(root, list(prompt), members)
    return root


def _insert(root: _Node, prompt: list[int], members: list[int]) -> None:
    node, depth = root, 0
    while depth < len(prompt):
        child = next((c for c in node.children if c.tokens[0] == prompt[depth]), None)
        if child is None:
            node.children.append(_Node(prompt[depth:], groups=[members]))
            return
        common = _common_length(child.tokens, prompt, depth)
        if common < len(child.tokens):  # split the edge where the prompts part
            tail = _Node(child.tokens[common:], child.children, child.groups)
            child.tokens, child.children, child.groups = child.tokens[:common], [tail], []
        node, depth = child, depth + common
    node.groups.append(members)


def _common_length(run: list[int], prompt: list[int], depth: int) -> int:
    n = min(len(run), len(prompt) - depth)
    for i in range(n):
        if run[i] != prompt[depth + i]:
            return i
    return n


def lay_out(
    root: _Node,
    seqs: Sequence[Sequence[int]],
    append: Append,
    rows: list[list[int]],
) -> None:
    """Append the tree's segments and every sequence's completion, depth first; fill
    `rows[i]` with the packed rows whose hidden states predict sequence i's completion."""

    def visit(node: _Node, parent: int | None, position: int, carried: list[int]) -> None:
        tokens = carried + node.tokens
        end = position + len(tokens)
        saved = len(tokens) * (node.consumers - 1)
        if saved >= MIN_SAVED_ROWS or any(len(g) > 1 for g in node.groups):
            segment, start = append(tokens, position, parent)
            for group in node.groups:
                _completions(group, seqs, end, segment, start + len(tokens) - 1, append, rows)
            for child in node.children:
                visit(child, segment, end, [])
            return
        for group in node.groups:  # single sequences: prompt run and completion in one
            (i,) = group
            _alone(i, seqs[i], tokens, position, parent, append, rows)
        for child in node.children:
            visit(child, parent, position, tokens)

    visit(root, None, 0, [])


def _completions(group, seqs, prompt_length, segment, last_row, append, rows) -> None:
    """Each completion behind its prompt's segment; the prompt's last row predicts its first
    token."""
    for i in group:
        completion = list(seqs[i][prompt_length:])
        if not completion:
            continue
        rows[i] = [last_row]
        if len(completion) > 1:
            _, start = append(completion[:-1], prompt_length, segment)
            rows[i] += range(start, start + len(completion) - 1)


def _alone(i, seq, prompt_run, position, parent, append, rows) -> None:
    """A sequence no other one shares its prompt with: the rest of its prompt and its
    completion in one causal segment."""
    prompt_length = position + len(prompt_run)
    if len(seq) == prompt_length:
        return
    _, start = append(prompt_run + list(seq[prompt_length:-1]), position, parent)
    first = start + len(prompt_run) - 1
    rows[i] = list(range(first, first + len(seq) - prompt_length))
