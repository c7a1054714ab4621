"""What the verifiers 0.4 tests share: the skip where 0.4 is not installed, and the test
environments (`verifiers_v1_envs/`) made importable by module name, in this process and in
the tool servers verifiers starts as processes of their own."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest

ENVS = Path(__file__).parent / "verifiers_v1_envs"
REPO = Path(__file__).parents[2]


def verifiers_version() -> tuple[int, int] | None:
    try:
        version = importlib.metadata.version("verifiers")
    except importlib.metadata.PackageNotFoundError:
        return None
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


requires_verifiers_04 = pytest.mark.skipif(
    (verifiers_version() or (0, 0)) < (0, 4),
    reason="needs verifiers 0.4 in its own environment (`make verifiers-venv`)",
)


def importable(monkeypatch, *folders: Path) -> None:
    """Put `folders` on the import path of this process and of its child processes."""
    for folder in folders:
        monkeypatch.syspath_prepend(str(folder))
    paths = [str(f) for f in folders] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
