"""The flows the addon adds to mitmproxy's: each request it made upstream as a flow of its
own, and what a spliced answer's own flow says of its handoffs.

The client's flow shows the stitched answer; the legs behind it and the questions asked
at start-up become flows next to it, so mitmweb shows them and `-w` records them.
`scripts/testbed/replay.py` serves them back.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

from mitmproxy import connection, ctx, http
from mitmproxy import flow as mflow

from addon.handoff.record import Handoff
from addon.servers.exchange import Exchange
from watchers.listeners import port_of

LEG_MARK = ":link:"
MARK = ":twisted_rightwards_arrows:"  # a spliced answer that was handed off


def as_flow(exchange: Exchange, answer: http.HTTPFlow | None = None) -> http.HTTPFlow:
    """The exchange as an HTTP flow; a leg names the client flow of its answer."""
    url = urlsplit(exchange.server)
    port = port_of(url)
    client = connection.Client(
        peername=("127.0.0.1", 0), sockname=("127.0.0.1", 0), timestamp_start=exchange.started
    )
    server = connection.Server(address=(url.hostname or "127.0.0.1", port))
    flow = http.HTTPFlow(client, server)
    flow.request = http.Request(
        host=url.hostname or "127.0.0.1",
        port=port,
        method=exchange.method.encode(),
        scheme=url.scheme.encode(),
        authority=b"",
        path=exchange.path.encode(),
        http_version=b"HTTP/1.1",
        headers=http.Headers(list(exchange.request_headers)),
        content=exchange.request_body,
        trailers=None,
        timestamp_start=exchange.started,
        timestamp_end=exchange.started,
    )
    if exchange.status is not None:
        flow.response = http.Response(
            http_version=b"HTTP/1.1",
            status_code=exchange.status,
            reason=b"",
            headers=http.Headers(list(exchange.response_headers)),
            content=bytes(exchange.received),
            trailers=None,
            timestamp_start=exchange.started,
            timestamp_end=exchange.ended or exchange.started,
        )
    elif exchange.error:
        # Only without a response: mitmproxy replays a loaded flow's response and error
        # as two events, and would save it twice. The comment and metadata say why anyway.
        flow.error = mflow.Error(exchange.error, exchange.ended)
    meta = exchange.metadata()
    if answer is not None:
        meta["answer"] = answer.id
    flow.metadata["spillover_exchange"] = meta
    flow.comment = exchange.describe()
    if exchange.purpose == "leg":
        flow.marked = LEG_MARK
    return flow


def flows_kept() -> bool:
    """Whether flows the addon makes would go anywhere: a view (mitmweb, the console) or
    a `-w` file. With neither they are not made (a leg's flow costs its answer's first
    token about 0.15 ms)."""
    return ctx.options.spillover_upstream_flows and bodies_kept()


def bodies_kept() -> bool:
    """Whether a flow's body goes anywhere once it has streamed: a view or a `-w` file
    (mitmdump alone keeps no flow, so an answer kept whole in it would only hold an open
    stream's memory: its every byte so far)."""
    return ctx.master.addons.get("view") is not None or bool(
        "save_stream_file" in ctx.options and ctx.options.save_stream_file
    )


def show(flow: http.HTTPFlow) -> None:
    """Put a flow the addon made itself where mitmproxy's own flows go: the view (mitmweb,
    the console) and the `-w` file."""
    if (view := ctx.master.addons.get("view")) is not None:
        view.add([flow])
    if (save := ctx.master.addons.get("save")) is not None:
        save.save_flow(flow)


def show_leg(answer: http.HTTPFlow, exchange: Exchange) -> None:
    leg = as_flow(exchange, answer)
    answer.metadata["spillover"].setdefault("legs", []).append(leg.id)
    show(leg)


def show_handoffs(answer: http.HTTPFlow, handoffs: Sequence[Handoff]) -> None:
    """The answer's handoffs in its flow: metadata, a comment line each, a mark."""
    answer.metadata["spillover"]["handoffs"] = [h.as_metadata() for h in handoffs]
    answer.comment = "\n".join(f"spillover: {h.describe()}" for h in handoffs)
    answer.marked = MARK
