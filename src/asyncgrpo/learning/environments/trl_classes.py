"""TRL's environment classes read as TRL 1.16 reads them, checked before anything starts.

`GRPOTrainer(environment_factory=Cls)` (or `{name: Cls}`) takes a class whose instances
are environments: `Cls()` with no argument, `reset(**row) -> str | None`, every other
public function of the class a tool (its name, type hints and docstring are the
schema), and optionally `get_reward()` (sync or async, no argument), an extra reward
column named after the class. TRL lists the members on the class with
`inspect.getmembers(cls, inspect.isfunction)`, so static methods are tools and class
methods, properties and `_private` names are not; we list them the same way.

What TRL finds only when the first batch fails, or never, is an error here, at start:
a factory that is an instance rather than a class, a constructor that needs arguments,
a class without `reset`, a tool whose hints cannot be written as a schema.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from asyncgrpo.base.config import ConfigError
from asyncgrpo.learning.agents.tools import tool_schema
from asyncgrpo.learning.rollout.episodes import import_dotted

NOT_TOOLS = ("reset", "get_reward")


@dataclass(frozen=True)
class EnvironmentKind:
    """One environment of `environment_factory`: its factory and what its class offers."""

    name: str | None  # the `environment` column's value naming it; None for a single factory
    factory: Callable[[], Any]
    cls: type
    tool_names: tuple[str, ...]
    has_reward: bool  # sync or async: the rollout awaits what get_reward() returns


def tool_method_names(cls: type) -> list[str]:
    """The public functions of `cls` other than `reset` and `get_reward`, sorted by name
    (TRL's order: `inspect.getmembers`)."""
    return [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if name not in NOT_TOOLS and not name.startswith("_")
    ]


def _needs_arguments(factory: Callable) -> list[str]:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a C type): let the call decide
        return []
    return [
        p.name
        for p in params
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def _environment_class(factory: Any, where: str) -> type:
    """The class a factory builds: the factory itself, or (a zero-argument function, as TRL
    also accepts) the type of one instance it makes."""
    if inspect.isclass(factory):
        cls = factory
    elif callable(factory) and not hasattr(factory, "reset"):
        missing = _needs_arguments(factory)
        if missing:
            raise ConfigError(
                f"{where}: the factory needs arguments {missing}; TRL calls it with none"
            )
        try:
            cls = type(factory())
        except Exception as exc:
            raise ConfigError(f"{where}: building a probe instance failed: {exc!r}") from exc
    else:
        raise ConfigError(
            f"{where}: expected a class (or a function returning an environment), got "
            f"{type(factory).__name__} instance {factory!r}: pass the class itself, not an instance"
        )
    missing = _needs_arguments(cls)
    if missing:
        raise ConfigError(
            f"{where}: {cls.__name__}() needs the arguments {missing}; TRL builds one instance "
            "per rollout with no argument (give them defaults, or pass a function that builds it)"
        )
    return cls


def read_environment(name: str | None, factory: Any) -> EnvironmentKind:
    """Check one factory and list its tools (see the module docstring)."""
    where = "environment_factory" if name is None else f"environment_factory[{name!r}]"
    cls = _environment_class(factory, where)
    if not callable(getattr(cls, "reset", None)):
        raise ConfigError(f"{where}: {cls.__name__} has no `reset` method (TRL requires one)")
    names = tool_method_names(cls)
    for method in names:
        try:
            tool_schema(_unbound_tool(cls, method))
        except (TypeError, NameError) as exc:
            raise ConfigError(f"{where}: {cls.__name__}.{method} cannot be a tool: {exc}") from exc
    get_reward = getattr(cls, "get_reward", None)
    return EnvironmentKind(
        name,
        factory,
        cls,
        tuple(names),
        inspect.isfunction(get_reward),
    )


def _unbound_tool(cls: type, method: str) -> Callable:
    """The function as an instance's bound method shows it (without `self`), for a schema
    check before any instance exists."""
    fn = getattr(cls, method)
    if isinstance(inspect.getattr_static(cls, method), staticmethod):
        return fn
    return types.MethodType(fn, object())


def read_environments(environment_factory: Any) -> list[EnvironmentKind]:
    """`environment_factory` as TRL takes it: one factory, or `{name: factory}`."""
    if isinstance(environment_factory, Mapping):
        if not environment_factory:
            raise ConfigError("environment_factory: an empty mapping names no environment")
        return [read_environment(str(n), f) for n, f in environment_factory.items()]
    return [read_environment(None, environment_factory)]


def check_tools(tools: Any) -> list[Callable]:
    """`tools=`: plain functions (sync or async) with schemas."""
    if tools is None:
        return []
    if callable(tools) or not isinstance(tools, list | tuple):
        tools = [tools]
    for fn in tools:
        if not callable(fn):
            raise ConfigError(f"tools: {fn!r} is not a function")
        try:
            tool_schema(fn)
        except (TypeError, NameError, ValueError) as exc:
            name = getattr(fn, "__name__", repr(fn))
            raise ConfigError(f"tools: {name} cannot be a tool: {exc}") from exc
    return list(tools)


def load_class(path: str) -> Any:
    """The factory at `package.module:Class` (`agent.environment`), found as
    `rollout.episodes.import_dotted` finds it."""
    try:
        return import_dotted(path)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"agent.environment: cannot load {path!r}: {exc}") from exc
