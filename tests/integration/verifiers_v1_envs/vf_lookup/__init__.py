"""A verifiers 0.4 tool environment for tests (`vf_lookup`): one shared `look` tool.

Laid out as `vf-init -T` lays out a package (`taskset.py`, `servers/`), importable by
module name when this folder is on the path.
"""

from vf_lookup.taskset import LookupTaskset

__all__ = ["LookupTaskset"]
