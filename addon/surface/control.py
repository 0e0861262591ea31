"""The control routes (/spillover/status, /metrics, POST /handoff), and who may use them.

They show live flows and servers and can move anyone's answer, so by default only
clients on this machine (loopback) are answered. A bearer token admits others. Anyone
else's request goes on to the primary like any other: to a stranger the routes do not
exist.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from mitmproxy import ctx, http

from addon.formats.shape import loads
from addon.servers.credentials import read_secret
from addon.surface.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from addon.surface.siblings import FANNED, PEER, Siblings, summed

CONTROL_PREFIX = "/spillover/"
log = logging.getLogger(__name__)
REASON_LIMIT = 200  # characters of a requested handoff's reason that reach the stream


def add_access_options(loader: Any) -> None:
    """Who may steer the addon, and which credentials go where (see servers/credentials.py)."""
    loader.add_option(
        "spillover_server_keys", str, "",
        "Each server's own API key, for the addon's questions and for fallback legs: "
        "URL=KEY,URL=@/path/to/file (a file keeps the key off the command line).",
    )  # fmt: skip
    loader.add_option(
        "spillover_forward_credentials", str, "",
        "Fallbacks that also get the client's own Authorization, X-Api-Key and Cookie headers "
        "(comma-separated URLs, or 'all'); the primary always gets them.",
    )  # fmt: skip
    loader.add_option(
        "spillover_control", bool, True,
        "Answer /spillover/status, /metrics and POST /spillover/handoff, /drain, /undrain on "
        "the proxy port, to clients on this machine (loopback) and bearers of the control token.",
    )  # fmt: skip
    loader.add_option(
        "spillover_control_local", bool, True,
        "Admit clients on this machine to the control routes without the token. Turn it off "
        "when a relay on this machine passes remote clients on (scripts.guard listening "
        "on a public address): they would all look local.",
    )  # fmt: skip
    loader.add_option(
        "spillover_control_token", str, "",
        "A bearer token that admits clients from other machines to the control routes "
        "(Authorization: Bearer TOKEN); @/path/to/file reads it from a file.",
    )  # fmt: skip


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


class Control:
    def __init__(
        self,
        handoff: Callable[[str | None, str], Awaitable[int]],
        status: Callable[[], dict[str, Any]],
        metrics: Callable[[], bytes],
        drain: Callable[[str, bool], dict[str, Any]],
    ) -> None:
        """`handoff(flow id or None for all, reason)` says how many answers moved;
        `drain(server URL, on)` drains a server or lets it take new requests again."""
        self.token = ""
        self.siblings = Siblings()
        # Until mitmproxy's `running` hook has come, some of its modes may not be up (the
        # local capture's redirector starts after the reverse port answers): not healthy.
        self.ready = False
        self._handoff = handoff
        self._status = status
        self._metrics = metrics
        self._drain = drain

    def configure(self, option: str) -> None:
        self.token = read_secret(option)

    def admits(self, flow: http.HTTPFlow) -> bool:
        """Whether this request may use the control routes. An admitted request's token
        is taken out of the flow, so recordings never hold it."""
        if not ctx.options.spillover_control:
            return False
        presented = flow.request.headers.get("authorization", "")
        scheme, _, given = presented.partition(" ")
        local = ctx.options.spillover_control_local and is_loopback(self._peer(flow))
        admitted = local or (
            bool(self.token)
            and scheme.lower() == "bearer"
            and hmac.compare_digest(given.strip().encode(), self.token.encode())
        )
        if admitted:
            flow.request.headers.pop("authorization", None)
        return admitted

    def _peer(self, flow: http.HTTPFlow) -> tuple | None:
        """The client's address: behind HAProxy (a worker with siblings, reached from
        loopback), the one HAProxy names (see surface/siblings.py)."""
        peer = flow.client_conn.peername
        named = flow.request.headers.get(PEER)
        if self.siblings.urls and named is not None and is_loopback(peer):
            return (named, 0)
        return peer

    async def answer(self, flow: http.HTTPFlow) -> None:
        """Answer an admitted control request; it never goes on to a server."""
        try:
            await self._answer(flow)
        except Exception:
            log.exception("control request %s failed", flow.request.path[:200])
            flow.response = _json(500, {"error": "the control request failed (see the log)"})

    async def _answer(self, flow: http.HTTPFlow) -> None:
        route = flow.request.path.split("?")[0][len(CONTROL_PREFIX) :]
        method = flow.request.method
        try:
            content = flow.request.content or b"{}"
        except ValueError:  # a Content-Encoding it is not in, or one mitmproxy cannot undo
            flow.response = _json(400, {"error": "the body cannot be decoded"})
            return
        # A request from outside goes to the other workers too (see surface/siblings.py).
        fan = bool(self.siblings.urls) and FANNED not in flow.request.headers
        if route == "handoff" and method == "POST":
            flow.response = await self._handoff_route(content)
            if fan and flow.response.status_code == 200:
                moved = sum(
                    r.get("handed_off", 0) for r in await self.siblings.post(route, content)
                )
                here = json.loads(flow.response.content)["handed_off"]
                flow.response = _json(200, {"handed_off": here + moved})
        elif route in ("drain", "undrain") and method == "POST":
            flow.response = self._drain_route(content, route == "drain")
            if fan and flow.response.status_code == 200:
                await self.siblings.post(route, content)
        elif route == "health" and method == "GET":  # the proxy itself answers: for a guard
            flow.response = (
                _json(200, {"ok": True})
                if self.ready
                else _json(503, {"ok": False, "why": "starting: not every proxy mode is up yet"})
            )
        elif route == "status" and method == "GET":
            status = self._status()
            if fan:
                status["other_workers"] = await self.siblings.get("status")
            flow.response = _json(200, status)
        elif route == "metrics" and method == "GET":
            metrics = self._metrics()
            if fan:
                metrics = summed(metrics, [m.decode() for m in await self.siblings.get("metrics")])
            flow.response = http.Response.make(200, metrics, {"content-type": METRICS_CONTENT_TYPE})
        else:
            flow.response = _json(404, {"error": f"no control route {flow.request.path}"})

    async def _handoff_route(self, content: bytes) -> http.Response:
        try:
            args = loads(content)
        except ValueError:
            args = None
        if not isinstance(args, dict):
            return _json(400, {"error": "body must be a JSON object"})
        wanted, reason = args.get("flow"), args.get("reason")
        if wanted is not None and not isinstance(wanted, str):
            return _json(400, {"error": "flow must be a flow id (a string)"})
        if reason is not None and not isinstance(reason, str):
            return _json(400, {"error": "reason must be a string"})
        why = "requested by POST /spillover/handoff"
        if reason:
            why += f": {' '.join(reason.split())[:REASON_LIMIT]}"
        return _json(200, {"handed_off": await self._handoff(wanted, why)})

    def _drain_route(self, content: bytes, on: bool) -> http.Response:
        try:
            server = loads(content).get("server")
        except (ValueError, AttributeError):
            server = None
        if not isinstance(server, str) or not server:
            return _json(400, {"error": 'body must be {"server": "http://host:port"}'})
        answer = self._drain(server, on)
        return _json(404 if "error" in answer else 200, answer)


def _json(status: int, payload: Any) -> http.Response:
    return http.Response.make(
        status, json.dumps(payload).encode(), {"content-type": "application/json"}
    )
