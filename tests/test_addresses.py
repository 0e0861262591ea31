"""Which redirected connections are the primary's (transparent and local capture modes):
the same address and port, or the same port on two addresses of this machine."""

from __future__ import annotations

from addon.servers.addresses import is_local, same_address, same_server


def test_a_connection_is_the_primarys_by_port_and_by_this_machines_addresses() -> None:
    here = "127.0.0.2"  # another address of this machine (Linux answers all of 127/8)
    assert is_local("127.0.0.1") and is_local(here) and not is_local("192.0.2.7")
    assert same_server("http://127.0.0.1:8081", "127.0.0.1", 8081)
    assert same_server("http://localhost:8081", here, 8081)  # both this machine's
    assert not same_server("http://127.0.0.1:8081", "127.0.0.1", 8082)
    assert not same_server("http://127.0.0.1:8081", "192.0.2.7", 8081)  # another machine
    assert same_server("http://192.0.2.7:8081", "192.0.2.7", 8081)
    assert not same_server("http://192.0.2.7:8081", "192.0.2.8", 8081)
    assert same_server("http://192.0.2.7", "192.0.2.7", 80)
    assert not same_server("http://no-such-host.invalid:8081", "127.0.0.1", 8081)


def test_two_urls_of_one_server_are_one_address() -> None:
    """How the options that name servers match them (addon/servers/keyed.py)."""
    assert same_address("http://localhost:8081", "http://127.0.0.1:8081")
    assert same_address("http://LOCALHOST:8081/v1", "http://127.0.0.1:8081")  # no path
    assert same_address("http://127.0.0.1:80", "http://127.0.0.1")  # http's own port
    assert same_address("https://localhost", "https://127.0.0.1:443")
    assert not same_address("https://127.0.0.1:8081", "http://127.0.0.1:8081")
    assert not same_address("http://127.0.0.1:8018", "http://127.0.0.1:8081")
    assert not same_address("http://192.0.2.7:8081", "http://127.0.0.1:8081")
