"""The base of every config section, and the error every config mistake becomes."""

from __future__ import annotations

from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration problem, phrased for the person who wrote the file."""


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True
    )


def section_types(annotation: Any) -> list[type[BaseModel]]:
    """The section classes a field holds: its class, each variant of a union of sections
    (`engine:`), or none for a plain value."""
    if isinstance(annotation, type):
        return [annotation] if issubclass(annotation, BaseModel) else []
    if get_origin(annotation) is Annotated:
        return section_types(get_args(annotation)[0])
    if get_origin(annotation) in (Union, UnionType):
        members = [section_types(arg) for arg in get_args(annotation)]
        return [cls for found in members for cls in found] if all(members) else []
    return []
