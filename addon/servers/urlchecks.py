"""What is wrong with the servers' URLs as a person gave them, one line each, said before
anything starts: by `spillover run` (scripts/cli.py) and by the addon's own option checks,
so that `mitmdump -s addon/spillover.py` users hear the same."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from mitmproxy.proxy.mode_specs import ProxyMode, ReverseMode

from addon.servers.addresses import same_server
from addon.servers.upstream import Upstream

SCHEMES = ("http", "https")
EVERY_INTERFACE = ("", "*")  # mitmproxy's listen_host for all of them


def url_mistake(url: str, role: str) -> str | None:
    """What is wrong with one server's URL (`role`: primary, fallback), or None. Every
    command that takes a server's or the proxy's URL says this same line."""
    if mistake := address_mistake(url, role):
        return mistake
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    if path or parts.query or parts.fragment:
        server = f"{parts.scheme}://{parts.netloc}"
        said = path or url[len(server) :]
        return (
            f"{role} {url}: drop the {said} (give {server}): the proxy serves the "
            "server's own paths, so clients keep theirs"
        )
    return None


def address_mistake(url: str, role: str) -> str | None:
    """What keeps `url` from naming an address (scheme, host, port), or None."""
    if "://" not in url:  # mitmproxy would take it for https
        return f"{role} {url} has no scheme: did you mean http://{url}?"
    try:
        parts = urlsplit(url)
    except ValueError:  # an unclosed [ of an IPv6 address
        return f"{role} {url} is not a URL"
    if parts.scheme.lower() not in SCHEMES:
        return f"{role} {url}: the scheme is {parts.scheme}://, not http:// or https://"
    if not parts.hostname:
        return f"{role} {url} names no host"
    try:
        parts.port  # noqa: B018 (it raises for a port out of range or not a number)
    except ValueError:
        return f"{role} {url}: its port is not a number from 0 to 65535"
    return None


def server_mistakes(
    primaries: Sequence[str], fallbacks: Sequence[str], listening: Sequence[tuple[str, int]]
) -> list[str]:
    """Each mistake in the servers given: a malformed URL, a fallback that is a primary or
    an earlier fallback again, a server at one of the proxy's own `listening` addresses
    (it would send answers to itself). Addresses of this machine are one machine's
    (127.0.0.1, localhost, 0.0.0.0 and its own)."""
    named = [("primary", url) for url in primaries] + [("fallback", url) for url in fallbacks]
    said = [mistake for role, url in named if (mistake := url_mistake(url, role))]
    if said:
        return said  # the rest compares addresses, which needs well-formed URLs
    for at, (role, url) in enumerate(named):
        server = Upstream(url.rstrip("/"))
        for other_role, other in named[:at]:
            if role == "fallback" and same_server(other, server.host, server.port):
                again = "the primary" if other_role == "primary" else f"the fallback {other}"
                said.append(f"fallback {url} is {again} again: a fallback is another server")
                break
        for host, port in listening:
            if same_server(url, "0.0.0.0" if host in EVERY_INTERFACE else host, port):
                said.append(
                    f"{role} {url} is this proxy's own address ({host or '*'}:{port}): "
                    "it would send answers to itself"
                )
    return said


def option_mistakes(options: Any) -> list[str]:
    """The mistakes in mitmproxy's options: spillover_primary (or else each reverse
    target as it was typed), spillover_fallbacks and the addresses its modes listen on."""
    modes = []
    for spec in options.mode:
        try:
            modes.append(ProxyMode.parse(spec))
        except ValueError:
            continue  # mitmproxy refuses it itself
    primaries = [options.spillover_primary] if options.spillover_primary else []
    primaries = primaries or [mode.data for mode in modes if isinstance(mode, ReverseMode)]
    fallbacks = [url.strip() for url in options.spillover_fallbacks.split(",") if url.strip()]
    listening = [
        (mode.listen_host(options.listen_host), port)
        for mode in modes
        if (port := mode.listen_port(options.listen_port))  # None, 0: no port of its own
    ]
    return server_mistakes(primaries, fallbacks, listening)
