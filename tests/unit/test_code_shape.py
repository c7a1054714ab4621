"""The package stays readable: small files, classes and functions, one meaning per class name.

The bounds are the project's (issue 27): no file over 450 lines, no class over 250, no
function over 60, and no two public classes of the package with the same name (a
newcomer reading `Sample` should not have to ask which one).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import asyncgrpo

PACKAGE = Path(asyncgrpo.__file__).parent
MAX_FILE, MAX_CLASS, MAX_FUNCTION = 450, 250, 60


def modules() -> list[tuple[Path, str, ast.Module]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        out.append((path.relative_to(PACKAGE), source, ast.parse(source)))
    return out


def spans(tree: ast.Module, kinds: tuple[type, ...]) -> list[tuple[str, int]]:
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, kinds)
    ]


def test_no_file_class_or_function_over_its_bound():
    too_long = []
    for path, source, tree in modules():
        if len(source.splitlines()) > MAX_FILE:
            too_long.append(f"{path}: {len(source.splitlines())} lines")
        for name, n in spans(tree, (ast.ClassDef,)):
            if n > MAX_CLASS:
                too_long.append(f"{path}: class {name} {n} lines")
        for name, n in spans(tree, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if n > MAX_FUNCTION:
                too_long.append(f"{path}: {name}() {n} lines")
    assert not too_long, "\n".join(too_long)


def test_no_two_public_classes_share_a_name():
    where = defaultdict(list)
    for path, _, tree in modules():
        for name, _ in spans(tree, (ast.ClassDef,)):
            if not name.startswith("_"):
                where[name].append(str(path))
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not shared, shared


def test_the_checks_see_the_package():
    # a bound that is never measured cannot fail: the walk must find the known big pieces
    found = {name for _, _, tree in modules() for name, _ in spans(tree, (ast.ClassDef,))}
    assert {"RolloutBuffer", "PolicyTrainer", "Scheduler"} <= found
