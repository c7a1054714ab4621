"""`base/ports.py`: one answer to "does this address stay on this host?" for every server."""

import socket

import pytest

from asyncgrpo.base.ports import free_port, is_loopback


@pytest.mark.parametrize(
    "host", ["localhost", "127.0.0.1", "127.8.9.10", "::1", "[::1]", "0:0:0:0:0:0:0:1"]
)
def test_loopback_names_and_addresses_stay_on_this_host(host):
    assert is_loopback(host)


@pytest.mark.parametrize(
    "host", ["0.0.0.0", "::", "[::]", "10.1.2.3", "192.168.0.1", "example.com", "", "[fe80::1]"]
)
def test_any_other_host_is_reachable_from_elsewhere(host):
    assert not is_loopback(host)


def test_a_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
