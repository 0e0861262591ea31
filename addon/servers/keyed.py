"""The options that name servers by URL, each entry matched to a server the proxy has.

spillover_cards, _remote_cards, _server_keys, _forward_credentials, _models, _templates
and _continue_by say something of a server. Each entry is matched once, when the option
or the servers change, to the configured server (the primary or a fallback) its URL
reaches, and is kept under that server's URL as configured: everything after looks a
server up by that URL alone. URLs are compared as the addresses they reach (scheme; host
as resolved, localhost, 127.0.0.1, ::1 and this machine's other addresses being one;
port, the scheme's own where none is written); a path is no part of it, nor whitespace
around an entry. An entry that reaches none of the servers, or a second entry for one
server, is a mistake said in one line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mitmproxy import exceptions
from mitmproxy.proxy.mode_specs import ProxyMode, ReverseMode

from addon.servers import credentials
from addon.servers.addresses import same_address, url_of
from addon.servers.declared import parse_ways
from addon.servers.urlchecks import address_mistake
from watchers.gates import parse_card_map
from watchers.prometheus import parse_selectors

CARDS, REMOTE_CARDS = "spillover_cards", "spillover_remote_cards"
KEYS, FORWARD = "spillover_server_keys", "spillover_forward_credentials"
MODELS, TEMPLATES, WAYS = "spillover_models", "spillover_templates", "spillover_continue_by"
# Each option's entries by URL as written; a malformed one raises ValueError or OptionsError.
PARSERS: dict[str, Callable[[str], Mapping[str, Any]]] = {
    CARDS: parse_card_map,
    REMOTE_CARDS: parse_selectors,
    KEYS: lambda text: credentials.url_pairs(text, KEYS, "KEY"),
    FORWARD: credentials.forwarded,
    MODELS: lambda text: credentials.url_pairs(text, MODELS, "MODEL"),
    TEMPLATES: lambda text: credentials.url_pairs(text, TEMPLATES, "FILE"),
    WAYS: parse_ways,
}
IN_SPILLOVER = {KEYS, FORWARD, MODELS, TEMPLATES, WAYS}  # the rest are MemoryWatch's


def resolved(option: str, entries: Mapping[str, Any], servers: Sequence[str]) -> dict[str, Any]:
    """`entries` (URL as written: value) by the server of `servers` each URL reaches;
    ValueError, in one line, for an entry that reaches none or a server named twice."""
    found: dict[str, Any] = {}
    written: dict[str, str] = {}
    for url, value in entries.items():
        if mistake := address_mistake(url, f"{option}:"):
            raise ValueError(mistake)
        server = url if url in servers else next((s for s in servers if same_address(url, s)), None)
        if server is None:
            here = ", ".join(servers) or "none"
            raise ValueError(f"{option}: {url} names no server here (servers: {here})")
        if server in found:
            raise ValueError(
                f"{option}: {written[server]} and {url} are one server, {server}: name it once"
            )
        found[server], written[server] = value, url
    return found


def by_server(option: str, text: str, servers: Sequence[str]) -> dict[str, Any]:
    """The value `text` of `option`, one of PARSERS, by the servers its entries name;
    ValueError, in one line, for any mistake in it."""
    try:
        return resolved(option, PARSERS[option](text), servers)
    except exceptions.OptionsError as exc:
        raise ValueError(str(exc)) from None


def keyed_mistakes(values: Mapping[str, str], servers: Sequence[str]) -> list[str]:
    """The mistake in each keyed option of `values` (name: value as given), said before
    anything starts by those who start the proxy (`spillover run`, `services install`)."""
    said = []
    for option in PARSERS:
        try:
            by_server(option, values.get(option, ""), servers)
        except ValueError as exc:
            said.append(str(exc))
    return said


def credentials_of(options: Any, servers: Sequence[str]) -> credentials.Credentials:
    """spillover_server_keys (each key read: `@FILE` is its file's first line) and
    spillover_forward_credentials, by server."""
    text = options.spillover_forward_credentials
    keys = by_server(KEYS, options.spillover_server_keys, servers)
    forward = by_server(FORWARD, text, servers)
    try:
        read = {server: credentials.read_secret(key) for server, key in keys.items()}
    except exceptions.OptionsError as exc:
        raise ValueError(str(exc)) from None
    return credentials.Credentials(read, forward, credentials.forwards_to_all(text))


def configured_servers(options: Any) -> list[str]:
    """The primaries and the fallbacks, by their URLs as the addon knows them."""
    return [*primaries_of(options), *fallbacks_of(options)]


def primaries_of(options: Any) -> list[str]:
    """spillover_primary, else each reverse target (`scheme://host:port`: as a flow to it
    names its server)."""
    if options.spillover_primary:
        return [options.spillover_primary.rstrip("/")]
    targets = []
    for spec in options.mode:
        try:
            mode = ProxyMode.parse(spec)
        except ValueError:
            continue  # mitmproxy refuses it itself
        if isinstance(mode, ReverseMode):
            targets.append(url_of(mode.scheme, *mode.address))
    return targets


def fallbacks_of(options: Any) -> list[str]:
    return [
        url.strip().rstrip("/") for url in options.spillover_fallbacks.split(",") if url.strip()
    ]
