"""Whether two addresses reach one server: the same, or both this machine's."""

from __future__ import annotations

import functools
import ipaddress
import socket
from urllib.parse import urlsplit

from addon.servers.upstream import Upstream


def same_server(url: str, host: str, port: int, resolve: bool = True) -> bool:
    """Whether a connection to `host`:`port` reaches the server at `url`: same port, and
    the same host, the same address once resolved, or two addresses of this machine (a
    server listening on all of them is reached through any). Without `resolve` no name
    is asked of DNS (a name other than localhost matches itself only): for the event
    loop, where a lookup would hold every answer."""
    named = urlsplit(url).hostname
    return bool(named) and Upstream(url).port == port and same_host(named or "", host, resolve)


def same_address(url: str, other: str, resolve: bool = True) -> bool:
    """Whether two well-formed server URLs reach one server: one scheme, one port (the
    scheme's own where none is given) and one host as `same_server` tells it; a path is
    no part of it."""
    there = urlsplit(other)
    if urlsplit(url).scheme != there.scheme:
        return False
    return same_server(url, there.hostname or "", Upstream(other).port, resolve)


def url_of(scheme: str, host: str, port: int) -> str:
    """A server's URL from its parts (an IPv6 address in brackets)."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def same_host(named: str, host: str, resolve: bool = True) -> bool:
    if named == host:
        return True
    try:
        if resolve:
            here, there = address_of(named), address_of(host)
        else:
            here, there = _written_address(named), _written_address(host)
        return here == there or (is_local(here) and is_local(there))
    except (OSError, ValueError):
        return False


def _written_address(host: str) -> str:
    """`host` as an address without a lookup: localhost, or an address however written;
    ValueError for any other name."""
    return "127.0.0.1" if host.lower() == "localhost" else str(ipaddress.ip_address(host))


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
