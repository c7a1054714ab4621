"""Ports and addresses: a free TCP port, and whether an address stays on this host.

Its own module at the bottom of the package: the engine process, the vLLM launcher and
NCCL group, and the trainer's rank store all need a port, and the servers and the config
all ask whether a host is loopback before they warn or refuse; none of them should import
another to get either.
"""

from __future__ import annotations

import ipaddress
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing listens on now (the OS picks; another process may still
    take it before the caller binds it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (127.0.0.0/8, ::1, bracketed `[::1]`)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
