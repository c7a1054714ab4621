"""The configuration reference page, rendered from the config models on every `mkdocs build`.

A hand-written list of fields drifts from the code; this page cannot. Its tables are the
lines of `asyncgrpo.base.config.describe()`, the function behind `asyncgrpo train
--help-config`, so the site and the command line print the same names, defaults and
docstrings. Sections that are off until set (`model.lora`, `agent.openenv`,
`agent.verifiers`) get their own tables, from the same function. The page exists only
inside the build (`File.generated`): nothing is written under `docs/`, and the site lands
in the ignored `build/site`.

A line of `describe()` that this module cannot read raises, and so fails the build.
"""

from __future__ import annotations

import inspect
import re
from typing import get_args

from mkdocs.structure.files import File, Files
from pydantic import BaseModel

from asyncgrpo.base.config import ENGINE_TYPES, RunConfig, describe
from asyncgrpo.base.config.base import section_types

PAGE = "reference/config.md"
CODE_SPAN = re.compile(r"(`[^`]*`)")

INTRO = """\
# Configuration reference

Every field a recipe, `--set` or `AsyncGRPOConfig` accepts, with its default and meaning.
This page is generated from the config models when the site is built (the same text as
`asyncgrpo train --help-config`), so it matches the code it was built from.

A field is set in a recipe's section (`trainer: {learning_rate: 2e-5}`), on the command
line by its dotted name (`--set trainer.learning_rate=2e-5`), or in Python by its dotted
name, by its own name where that is unique (`AsyncGRPOConfig(learning_rate=2e-5)`), or by
TRL's name (see [Coming from TRL](../trl.md)). An unknown key is refused with the closest
valid name.
"""


def on_files(files: Files, config) -> Files:
    """mkdocs hook: add the generated page to the site's files."""
    files.append(File.generated(config, PAGE, content=render()))
    return files


def render() -> str:
    """The whole page: a heading per section, a table row per field."""
    out = [INTRO]
    for section, items in _by_section(describe()).items():
        out.append(_section(section, items))
    return "\n".join(out)


def _by_section(lines: list[str]) -> dict[str, list[tuple[str, ...]]]:
    """describe()'s lines by top-level section, in order: ("field", name, default, doc),
    or ("only", types) where the fields that only some engine types take begin."""
    sections: dict[str, list[tuple[str, ...]]] = {}
    for line in lines:
        if line.startswith("# "):  # "# engine.type: embedded or vllm only"
            dotted, types = line.removeprefix("# ").split(": ", 1)
            sections[dotted.split(".")[0]].append(("only", types.removesuffix(" only")))
            continue
        field = _read(line)
        section = field[1].split(".")[0] if "." in field[1] else ""
        sections.setdefault(section, []).append(field)
    return sections


def _read(line: str) -> tuple[str, str, str, str]:
    """("field", dotted name, default, doc) from `name = default  # doc`."""
    if " = " not in line or "  # " not in line:
        raise ValueError(f"config reference: cannot read describe()'s line {line!r}")
    dotted, rest = line.split(" = ", 1)
    default, doc = rest.rsplit("  # ", 1)  # a doc is one-spaced: the last "  # " starts it
    return ("field", dotted, default, doc)


def _section(section: str, items: list[tuple[str, ...]]) -> str:
    out = [f"## `{section}`" if section else "## Top level", ""]
    about = _section_doc(section)
    out += [about, ""] if about else []
    out += _table(items)
    for dotted, cls in _optional_sections(section):
        out += ["", f"### `{dotted}`", ""]
        about = _doc(cls)
        out += [f"Off until set. {about}", ""] if about else ["Off until set.", ""]
        out += _table([_read(line) for line in describe(cls, f"{dotted}.")])
    return "\n".join(out) + "\n"


def _table(items: list[tuple[str, ...]]) -> list[str]:
    head = ["| field | default | meaning |", "|---|---|---|"]
    out = list(head)
    for item in items:
        if item[0] == "only":
            out += ["", f"### Only with `engine.type` {item[1]}", ""] + head
        else:
            _, dotted, default, doc = item
            out.append(f"| `{dotted}` | `{default}` | {_text(doc)} |")
    return out


def _optional_sections(section: str) -> list[tuple[str, type[BaseModel]]]:
    """Fields of a section that hold a section or None (`model.lora`): describe() shows
    them as one value; their own fields are listed below the section's table."""
    if not section:
        return []
    found = []
    for cls in section_types(RunConfig.model_fields[section].annotation):
        for name, field in cls.model_fields.items():
            members = [arg for arg in get_args(field.annotation) if arg is not type(None)]
            if len(members) == 1 and section_types(members[0]):
                found.append((f"{section}.{name}", members[0]))
    return found


def _section_doc(section: str) -> str:
    """The section class's docstring (for `engine`, one line per engine type)."""
    if not section:
        return _doc(RunConfig)
    if section == "engine":
        kinds = "\n".join(f"- {_doc(cls)}" for cls in ENGINE_TYPES.values())  # each names its type
        return f"`engine.type` picks the engine; each type takes its own fields.\n\n{kinds}"
    classes = section_types(RunConfig.model_fields[section].annotation)
    return _doc(classes[0]) if classes else ""


def _doc(cls: type) -> str:
    """The class's own docstring (not a base class's) as one Markdown paragraph."""
    own = cls.__dict__.get("__doc__")
    return _text(" ".join(inspect.cleandoc(own).split())) if own else ""


def _text(text: str) -> str:
    """Docstring prose as Markdown: code spans kept as they are (a pipe inside backticks
    does not split Python-Markdown's table cells), markup characters outside them escaped."""
    parts = CODE_SPAN.split(text)
    for i, part in enumerate(parts):
        if i % 2 == 0:
            part = part.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            parts[i] = re.sub(r"([*_|\[\]\\])", r"\\\1", part)
    return "".join(parts)
