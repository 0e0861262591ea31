"""The options file `services install` writes (mitmproxy's own format, in a confdir of
its own), or keeps as a person left it, mending only what no longer fits: an addon file
an earlier version named, and a proxy port other than the units'."""

from __future__ import annotations

import argparse
import json
import re
import secrets
from pathlib import Path

# An options file an earlier version wrote named the addon's file in a checkout; the
# proxy unit's `spillover run` loads the addon itself now.
OLD_SCRIPTS = re.compile(r"^scripts:\n  - \S*addon/spillover\.py\n", re.MULTILINE)
# The proxy's own port in the reverse mode it writes (the guard is told the same port).
PROXY_PORT = re.compile(r"^(  - reverse:\S+@127\.0\.0\.1:)(\d+)$", re.MULTILINE)


def ensure_token(path: Path) -> Path:
    """The control token the proxy and the guard share (made once, readable by its owner
    only): the guard's health check carries it where local clients are not trusted."""
    if not path.exists():
        path.touch(mode=0o600)
        path.write_text(secrets.token_urlsafe(32) + "\n")
    return path


def options_file(
    primary: str,
    fallbacks: str,
    proxy_port: int,
    token: Path | None,
    routed: bool = False,
    cards: str = "",
) -> str:
    """`token`: the control token's file, where the guard is public; `routed`: the unit's
    command names the primary and the fallbacks (workers behind HAProxy, each on a port of
    its own; the transparent mode); `cards`: a spillover_cards line."""
    # Behind a guard on a public address every client looks local: no control without
    # the token then (the guard has it too, for its health check). Behind HAProxy (the
    # workers) the control routes see each client's own address.
    local = ""
    if token is not None and not routed:
        local = (
            f"spillover_control_local: false\nspillover_control_token: {json.dumps(f'@{token}')}\n"
        )
    route = "" if routed else (
        "mode:\n"
        f"  - reverse:{primary}@127.0.0.1:{proxy_port}\n"
        f"spillover_fallbacks: {json.dumps(fallbacks)}\n"  # (YAML reads an empty value as null)
    )  # fmt: skip
    named = f"{cards}\n" if cards else ""
    return (
        "# The spillover proxy's options, in mitmproxy's own format: any mitmproxy option\n"
        "# or spillover_* option (docs/running.md lists them). Restart the service after an edit:\n"
        "#   systemctl [--user] restart spillover-proxy\n"
        f"{route}{local}{named}"
        "flow_detail: 0\n"
    )


def write_or_keep(
    options: Path, args: argparse.Namespace, token: Path | None, routed: bool, cards: str
) -> None:
    """`cards`: the spillover_cards line the service user needs, or ''."""
    if not options.exists():
        options.write_text(
            options_file(args.primary, args.fallbacks, args.proxy_port, token, routed, cards)
        )
        print(f"services: wrote {options}" + (f" with {cards}" if cards else ""))
        return
    print(f"services: keeping {options} as it is")
    kept = options.read_text()
    given = [args.primary, *filter(None, args.fallbacks.split(","))]
    if not routed and (missing := [url for url in given if url not in kept]):
        print(
            f"services: WARNING: {options} does not name {', '.join(missing)}, given now: "
            "edit it, or uninstall --purge and install again"
        )
    if OLD_SCRIPTS.search(kept):
        kept = OLD_SCRIPTS.sub("", kept)
        print(f"services: {options} named the addon's file: removed (the unit loads it)")
    if not routed and (port := PROXY_PORT.search(kept)) and int(port[2]) != args.proxy_port:
        kept = PROXY_PORT.sub(rf"\g<1>{args.proxy_port}", kept)
        print(
            f"services: {options} had the proxy on port {port[2]}: now {args.proxy_port}, "
            "where the guard looks for it (--proxy-port)"
        )
    if kept != options.read_text():
        options.write_text(kept)
    if token and not routed and "spillover_control_token" not in kept:
        print(
            f"services: the guard checks the proxy with the token in {token}: "
            f"add spillover_control_token: '@{token}' to {options}"
        )
    if cards and "spillover_cards" in kept:
        print(f"services: {options} names its own spillover_cards: kept ({cards} found here)")
    elif cards:
        print(f"services: add this line to {options}: {cards}")
