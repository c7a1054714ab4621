"""A free TCP port for a server or process group this run starts.

Its own module at the bottom of the package: the engine process, the vLLM launcher and
NCCL group, and the trainer's rank store all need one, and none of them should import
another to get it.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing listens on now (the OS picks; another process may still
    take it before the caller binds it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
