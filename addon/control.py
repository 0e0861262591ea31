"""Who may use the control routes (/spillover/status, /metrics, /handoff).

They show live flows and servers and can move anyone's answer, so by default only
clients on this machine (loopback) are answered. A bearer token admits others. Anyone
else's request goes on to the primary like any other: to a stranger the routes do not
exist.
"""

from __future__ import annotations

import hmac
import ipaddress
from pathlib import Path

from mitmproxy import ctx, exceptions, http


def read_secret(value: str) -> str:
    """An option's secret: the value itself, or a file's first line for `@/path`, so the
    secret need not appear on a command line (where `ps` shows it)."""
    if not value.startswith("@"):
        return value
    try:
        lines = Path(value[1:]).read_text().splitlines()
    except OSError as exc:
        raise exceptions.OptionsError(f"cannot read secret from {value[1:]}: {exc}") from None
    return lines[0].strip() if lines else ""


def is_loopback(peer: tuple | None) -> bool:
    if not peer:
        return False
    try:
        address = ipaddress.ip_address(str(peer[0]).split("%")[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


class ControlAccess:
    def __init__(self) -> None:
        self.token = ""

    def configure(self, option: str) -> None:
        self.token = read_secret(option)

    def admits(self, flow: http.HTTPFlow) -> bool:
        """Whether this request may use the control routes. An admitted request's token
        is taken out of the flow, so recordings never hold it."""
        if not ctx.options.spillover_control:
            return False
        presented = flow.request.headers.get("authorization", "")
        scheme, _, given = presented.partition(" ")
        admitted = is_loopback(flow.client_conn.peername) or (
            bool(self.token)
            and scheme.lower() == "bearer"
            and hmac.compare_digest(given.strip().encode(), self.token.encode())
        )
        if admitted:
            flow.request.headers.pop("authorization", None)
        return admitted
