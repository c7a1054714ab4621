"""Loading a section that is a union of variants (`engine:`, discriminated by `type`).

Validation errors inside a variant carry its tag in their path (`engine.vllm.num_threads`);
`untag` takes it out again, and `misplaced` turns a key of another variant into an error
that names the type it applies to. `drop_unset_keys` first leaves out such keys at their
default, which configure nothing (an older `config.yaml` lists every engine field).
`switch_type` keeps `--set engine.type=vllm` on a recipe written for the embedded engine
working: the recipe's own keys for another type are left out, with a warning, while keys
given by `--set` are validated as they are. `describe_engine` lists the variants' fields
for `--help-config`, shared fields first, then each type's.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel

from asyncgrpo.base.config.engine import (
    ENGINE_TYPES,
    EngineSettings,
    at_other_types_default,
    other_variant_keys,
    variants_of,
)

logger = logging.getLogger(__name__)

ENGINE = "engine"  # the union's field in a RunConfig


def untag(model: type[BaseModel], path: tuple) -> tuple[tuple, str | None, int | None]:
    """(path without a variant's tag, that variant's type, the depth of its section's keys);
    the type and depth are None outside an engine section."""
    if model in ENGINE_TYPES.values():  # `asyncgrpo serve`: the section is the whole config
        return path, model.model_fields["type"].default, 1
    if len(path) >= 2 and path[0] == ENGINE and path[1] in ENGINE_TYPES:
        return (ENGINE, *path[2:]), str(path[1]), 2
    return path, None, None


def misplaced(path: tuple, engine_type: str | None, depth: int | None) -> str | None:
    """The error for a key of an engine section that belongs to other types only."""
    if engine_type is None or len(path) != depth:
        return None
    owners = variants_of(str(path[-1]))
    if not owners:
        return None
    dotted = ".".join(str(p) for p in path)
    return (
        f"'{dotted}' applies to engine.type: {' or '.join(owners)}, and this engine's type "
        f"is {engine_type}"
    )


def variant_fields(engine_type: str) -> list[str]:
    """The keys an engine section of `engine_type` takes."""
    return list(ENGINE_TYPES[engine_type].model_fields)


def drop_unset_keys(model: type[BaseModel], data: dict) -> None:
    """Leave out the engine section's keys of other types that hold their defaults (what a
    whole section dumped by an older asyncgrpo holds): only a value that says something
    is refused."""
    if model in ENGINE_TYPES.values():
        for key in at_other_types_default({"type": model.model_fields["type"].default, **data}):
            data.pop(key)
    elif isinstance(data.get(ENGINE), dict):
        unset = at_other_types_default(data[ENGINE])
        data[ENGINE] = {k: v for k, v in data[ENGINE].items() if k not in unset}


def switch_type(recipe: dict, data: dict) -> list[str]:
    """Leave out of `data`'s engine section the keys the recipe gave for another type, when
    an override (`--set engine.type=...`, `use_vllm=true`) changed the recipe's type; the
    keys left out, as dotted names. Keys the overrides gave stay, to be refused if wrong."""
    section = data.get(ENGINE)
    written = recipe.get(ENGINE)
    if not isinstance(section, dict) or not isinstance(written, dict):
        return []
    recipe_type = written.get("type", "vllm" if recipe.get("use_vllm") else "embedded")
    if section.get("type", "embedded") == recipe_type:
        return []
    dropped = [
        key
        for key in other_variant_keys(section)
        if key in written and section[key] == written[key]
    ]
    data[ENGINE] = {k: v for k, v in section.items() if k not in dropped}
    names = [f"{ENGINE}.{key}" for key in dropped]
    if names:
        chosen = section.get("type", "embedded")
        logger.warning(
            "engine.type %s (an override of the recipe's %s): leaving out the recipe's %s, "
            "which engine.type %s does not take",
            chosen,
            recipe_type,
            ", ".join(names),
            chosen,
        )
    return names


def describe_engine(prefix: str, line: Any) -> list[str]:
    """`--help-config` lines of the engine section: `type`, the fields every type has, then
    each group of types with the fields only they have. `line(name, field)` formats one."""
    lines = [line(f"{prefix}type", EngineSettings.model_fields["type"])]
    groups: dict[tuple[str, ...], list[str]] = {}
    for cls in ENGINE_TYPES.values():
        for name in cls.model_fields:
            owners = tuple(variants_of(name))
            if name != "type" and name not in groups.setdefault(owners, []):
                groups[owners].append(name)
    for owners, names in groups.items():
        if len(owners) < len(ENGINE_TYPES):
            lines.append(f"# {prefix}type: {' or '.join(owners)} only")
        for name in names:
            lines.append(line(f"{prefix}{name}", ENGINE_TYPES[owners[0]].model_fields[name]))
    return lines
