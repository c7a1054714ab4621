"""Fails the site's build when a page names something the code does not have.

The manual names config fields (`trainer.learning_rate`), modules
(`asyncgrpo.learning.agents`), repository files (`recipes/default.yaml`) and tests
(`test_faults.py::test_...`) in code spans and command blocks. A rename in the code would
leave such a name stale without any broken link to show it, so every page is read at
build time and each name is looked up:

- a config field: walked through the config models from `RunConfig`, the engine types
  and the sections that are off until set (`model.lora`) included; a `--set` key may also
  be a flat or TRL name, as `--set` takes them;
- a module or object under `asyncgrpo`: found as a module, then as its attributes;
- a path under `src/`, `recipes/`, `examples/`, `benchmarks/`, `tests/`, `docs/`, `.ci/`:
  present in the checkout (`*` and `{a,b}` expanded; `benchmarks/results/` is written by
  the benchmarks, so it is not looked for);
- a test `file.py::test_name` (or `::test_name` after one on the same line): a function of
  that name in that file under `tests/`.

A name that is not found is a warning, and `mkdocs build --strict` fails on warnings.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import re
from functools import cache
from pathlib import Path
from typing import Any, get_args

from asyncgrpo.base.config import RunConfig
from asyncgrpo.base.config.base import section_types
from asyncgrpo.base.config.trl_names import known_names

log = logging.getLogger("mkdocs.hooks.name_check")

ROOT = Path(__file__).resolve().parents[2]
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
SET_OVERRIDE = re.compile(r"--set '?([\w.]+)=")
DOTTED = re.compile(r"(?<![\w/.\-])([a-z_]+(?:\.[a-z_0-9]+)+)(?![\w(])")
MODULE = re.compile(r"(?<![\w/.\-])(asyncgrpo(?:\.\w+)+)")
REPO_PATH = re.compile(
    r"(?<![\w/.\-~])((?:src|recipes|examples|benchmarks|tests|docs|\.ci)/[\w./*{},\-]*)"
)
TEST_REF = re.compile(r"(?:([\w]+\.py))?::(test_\w+)")
FILE_SUFFIXES = {"json", "jsonl", "log", "yaml", "py", "md", "png", "safetensors", "txt"}
WRITTEN_BY_RUNS = ("benchmarks/results/",)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """mkdocs hook: warn about every name on the page that the code does not have."""
    for problem in problems(markdown):
        log.warning("%s: %s", page.file.src_uri, problem)
    return markdown


def problems(markdown: str) -> list[str]:
    """What on a page names nothing: one message per unknown name."""
    spans = CODE_SPAN.findall(FENCE.sub("", markdown))
    fences = FENCE.findall(markdown)
    found = []
    for text in spans:
        found += [f"no config field `{n}`" for n in DOTTED.findall(text) if not _field_ok(n)]
    for text in fences:
        found += [f"no config key `{n}`" for n in SET_OVERRIDE.findall(text) if not _key(n)]
    for text in spans + fences:
        found += [f"no module or object `{n}`" for n in MODULE.findall(text) if not _module(n)]
        found += [f"no file `{p}` in the checkout" for p in REPO_PATH.findall(text) if not _path(p)]
    for line in markdown.splitlines():
        found += _tests_on(line)
    return found


def _field_ok(dotted: str) -> bool:
    """A dotted name in prose code: a config field, or not meant as one (a file, a call)."""
    head, *_, last = dotted.split(".")
    if head not in _sections() or last in FILE_SUFFIXES:
        return True
    return _field(dotted)


def _key(name: str) -> bool:
    """A `--set` key: a dotted field, or a top-level, flat or TRL name (`learning_rate`)."""
    return _field(name) if "." in name else name in known_names(RunConfig)


@cache
def _sections() -> frozenset[str]:
    return frozenset(n for n, f in RunConfig.model_fields.items() if _section_classes(f))


@cache
def _field(dotted: str) -> bool:
    """Whether `dotted` names a config field (or a key inside a field that holds a dict)."""
    models: list[Any] = [RunConfig]
    for part in dotted.split("."):
        fields = [m.model_fields[part] for m in models if part in m.model_fields]
        if not fields:
            return False
        models = [cls for field in fields for cls in _section_classes(field)]
        if not models:
            return True  # a plain value: whatever follows is a key inside it
    return True


def _section_classes(field: Any) -> list[Any]:
    """The sections a field holds: its section types, or the one of `Section | None`."""
    found = section_types(field.annotation)
    if found:
        return found
    return [cls for arg in get_args(field.annotation) for cls in section_types(arg)]


@cache
def _module(dotted: str) -> bool:
    """Whether `dotted` is a module under asyncgrpo, or an object inside one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        if importlib.util.find_spec(name) is None:
            continue
        if cut == len(parts):
            return True
        obj: Any = importlib.import_module(name)
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@cache
def _path(path: str) -> bool:
    """Whether a repository path exists (a glob or a `{a,b}` choice: every expansion)."""
    path = path.rstrip(".,")
    if path.startswith(WRITTEN_BY_RUNS):
        return True
    return all(_exists(choice) for choice in _expand(path))


def _expand(path: str) -> list[str]:
    match = re.search(r"\{([^}]*)\}", path)
    if not match:
        return [path]
    head, tail = path[: match.start()], path[match.end() :]
    return [x for choice in match.group(1).split(",") for x in _expand(head + choice + tail)]


def _exists(path: str) -> bool:
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


def _tests_on(line: str) -> list[str]:
    """`file.py::test_name` references on one line; `::test_other` reuses the last file."""
    found, current = [], None
    for file, test in TEST_REF.findall(line):
        current = file or current
        if current is None or not _test(current, test):
            found.append(f"no test `{current}::{test}` under tests/")
    return found


@cache
def _test(file: str, test: str) -> bool:
    return any(
        re.search(rf"^\s*(async )?def {test}\(", path.read_text(), re.M)
        for path in (ROOT / "tests").rglob(file)
    )
