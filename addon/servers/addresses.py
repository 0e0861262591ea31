"""Whether two addresses reach one server: the same, or both this machine's."""

from __future__ import annotations

import functools
import ipaddress
import socket
from urllib.parse import urlsplit

from addon.servers.upstream import Upstream


def same_server(url: str, host: str, port: int) -> bool:
    """Whether a connection to `host`:`port` reaches the server at `url`: same port, and
    the same address or two addresses of this machine (a server listening on all of
    them is reached through any)."""
    named = urlsplit(url).hostname
    if not named or Upstream(url).port != port:
        return False
    if named == host:
        return True
    try:
        return is_local(address_of(named)) and is_local(address_of(host))
    except (OSError, ValueError):
        return False


@functools.lru_cache(maxsize=64)
def address_of(host: str) -> str:
    """`host`'s first address (a name resolved once, an address as it is)."""
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]


@functools.lru_cache(maxsize=64)
def is_local(address: str) -> bool:
    """Whether `address` is one of this machine's (in this network namespace)."""
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True
