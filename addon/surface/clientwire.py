"""Where a spliced answer's body may go to the client's connection itself
(answer/clientwire.py): a client that mitmproxy reads and writes as plain HTTP/1.1 over
TCP, whose bodies nothing keeps or shows (a view, a `-w` file, `store_streamed_bodies`:
they read the body as mitmproxy passes it on). The connection is mitmproxy's own, found
where its proxy server keeps it; a mitmproxy that keeps it elsewhere passes every byte on
itself, as before."""

from __future__ import annotations

import asyncio

from mitmproxy import ctx, http

from addon.answer.clientwire import ClientWire, hand_over
from addon.answer.endpoint import HttpClientStream, SpliceEndpoint
from addon.answer.splice import Splice
from addon.surface.flows import bodies_kept


def add_client_wire_options(loader) -> None:
    loader.add_option(
        "spillover_client_wire", bool, True,
        "Past a streamed answer's first event, write its body to the client's connection "
        "from the addon, not through mitmproxy's layers a second time (about half of the "
        "proxy's CPU per event). Never where a view, a -w file or store_streamed_bodies "
        "reads the body; false: mitmproxy passes every byte on.",
    )  # fmt: skip


def hand_over_when_passed(flow: http.HTTPFlow, splice: Splice, endpoint: SpliceEndpoint) -> None:
    """A streamed answer's body goes on to its client's connection once mitmproxy has
    passed on what it was given, where it may."""
    answer, response = splice.client, flow.response
    if isinstance(answer, HttpClientStream) and (wire := client_wire(flow)) is not None:
        assert response is not None
        response.stream = hand_over(answer, wire, response, endpoint.handed)


def client_wire(flow: http.HTTPFlow) -> ClientWire | None:
    client, response = flow.client_conn, flow.response
    if not ctx.options.spillover_client_wire or response is None:
        return None
    if bodies_kept() or ctx.options.store_streamed_bodies:
        return None
    if client.tls or client.transport_protocol != "tcp" or flow.request.http_version != "HTTP/1.1":
        return None
    handler = getattr(ctx.master.addons.get("proxyserver"), "connections", {}).get(client.id)
    io = getattr(handler, "transports", {}).get(client)
    writer = getattr(io, "writer", None)
    watchdog = getattr(handler, "timeout_watchdog", None)
    if not isinstance(writer, asyncio.StreamWriter) or watchdog is None:
        return None
    chunked = "chunked" in response.headers.get("transfer-encoding", "").lower()
    return ClientWire(writer, chunked, watchdog.register_activity)
