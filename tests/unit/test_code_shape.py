"""The package stays readable: small files, classes and functions, one meaning per class name.

The bounds are the project's: no file over 450 lines, no class over 250, no
function over 60, and no two public classes of the package with the same name (a
newcomer reading `Sample` should not have to ask which one). The scripts under
`benchmarks/` are read as often as the package and keep the same three size bounds; the
name rule is the package's only (every script may have its own `main`).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

import asyncgrpo

PACKAGE = Path(asyncgrpo.__file__).parent
# the repository's, found from this file: the installed package may live elsewhere
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
MAX_FILE, MAX_CLASS, MAX_FUNCTION = 450, 250, 60


def parsed(paths: list[Path], relative_to: Path) -> list[tuple[Path, str, ast.Module]]:
    out = []
    for path in sorted(paths):
        source = path.read_text()
        out.append((path.relative_to(relative_to), source, ast.parse(source)))
    return out


@pytest.fixture(scope="module")
def modules() -> list[tuple[Path, str, ast.Module]]:
    """The package parsed once for the module's tests (about a second per parse); they
    only read it."""
    return parsed(list(PACKAGE.rglob("*.py")), PACKAGE)


def benchmark_scripts() -> list[tuple[Path, str, ast.Module]]:
    return parsed(list(BENCHMARKS.glob("*.py")), BENCHMARKS.parent)


def spans(tree: ast.Module, kinds: tuple[type, ...]) -> list[tuple[str, int]]:
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, kinds)
    ]


def over_bounds(files: list[tuple[Path, str, ast.Module]]) -> list[str]:
    too_long = []
    for path, source, tree in files:
        if len(source.splitlines()) > MAX_FILE:
            too_long.append(f"{path}: {len(source.splitlines())} lines")
        for name, n in spans(tree, (ast.ClassDef,)):
            if n > MAX_CLASS:
                too_long.append(f"{path}: class {name} {n} lines")
        for name, n in spans(tree, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if n > MAX_FUNCTION:
                too_long.append(f"{path}: {name}() {n} lines")
    return too_long


def test_no_file_class_or_function_over_its_bound(modules):
    too_long = over_bounds(modules)
    assert not too_long, "\n".join(too_long)


def test_no_benchmark_script_over_the_bounds():
    scripts = benchmark_scripts()
    # a walk that finds nothing passes: it must see the scripts, the two longest included
    assert {"end_to_end.py", "trl_baseline.py"} <= {path.name for path, _, _ in scripts}
    too_long = over_bounds(scripts)
    assert not too_long, "\n".join(too_long)


def test_no_two_public_classes_share_a_name(modules):
    where = defaultdict(list)
    for path, _, tree in modules:
        for name, _ in spans(tree, (ast.ClassDef,)):
            if not name.startswith("_"):
                where[name].append(str(path))
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not shared, shared


def test_the_checks_see_the_package(modules):
    # a bound that is never measured cannot fail: the walk must find the known big pieces
    found = {name for _, _, tree in modules for name, _ in spans(tree, (ast.ClassDef,))}
    assert {"RolloutBuffer", "PolicyTrainer", "Scheduler"} <= found
