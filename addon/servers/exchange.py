"""Every request the addon itself makes upstream, kept as a flow of its own.

The client's flow shows the stitched answer; the legs behind it (what each server was
asked, what came back up to the cut, why it ended) and the questions asked at start-up
(`/props`, `/v1/models`, `/tokenize`, the prefill probe) become flows next to it, so
mitmweb shows them and `-w` records them. `scripts/replay.py` serves them back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from mitmproxy import connection, ctx, http
from mitmproxy import flow as mflow

LEG_MARK = ":link:"
KEEP_BYTES = 4 * 1024 * 1024  # of one response; past that a flow says how much it left out


@dataclass
class Exchange:
    server: str
    method: str
    path: str
    request_headers: list[tuple[bytes, bytes]]
    request_body: bytes
    purpose: str  # "leg" (part of an answer) or "question" (the addon asking a server)
    leg: int | None = None  # the leg's place on the answer's ladder
    started: float = field(default_factory=time.time)
    status: int | None = None
    response_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    received: bytearray = field(default_factory=bytearray)
    received_bytes: int = 0  # all of it, kept or not
    ended: float | None = None
    outcome: str = "complete"  # complete, handed off, failed, cancelled
    error: str | None = None

    def respond(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status, self.response_headers = status, headers

    def keep(self, data: bytes) -> None:
        """Keep response bytes for the flow, up to KEEP_BYTES: the client's own flow
        holds the answer, so a leg's copy of a huge body would only double it."""
        room = KEEP_BYTES - len(self.received)
        if room > 0:
            self.received += data[:room]
        self.received_bytes += len(data)

    def end(self, outcome: str, error: str | None = None) -> None:
        self.outcome, self.error, self.ended = outcome, error, time.time()

    def metadata(self) -> dict[str, Any]:
        return {
            "purpose": self.purpose,
            "server": self.server,
            "leg": self.leg,
            "outcome": self.outcome,
            "error": self.error,
            "received_bytes": self.received_bytes,
            "kept_bytes": len(self.received),
        }

    def describe(self) -> str:
        what = f"leg {self.leg}" if self.purpose == "leg" else "question"
        why = f": {self.error}" if self.error else ""
        return f"spillover {what} to {self.server}: {self.outcome}{why}"


def as_flow(exchange: Exchange, answer: http.HTTPFlow | None = None) -> http.HTTPFlow:
    """The exchange as an HTTP flow; a leg names the client flow of its answer."""
    url = urlsplit(exchange.server)
    port = url.port or (443 if url.scheme == "https" else 80)
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
    return ctx.options.spillover_upstream_flows and (
        ctx.master.addons.get("view") is not None
        or bool("save_stream_file" in ctx.options and ctx.options.save_stream_file)
    )


def show(flow: http.HTTPFlow) -> None:
    """Put a flow the addon made itself where mitmproxy's own flows go: the view (mitmweb,
    the console) and the `-w` file."""
    if (view := ctx.master.addons.get("view")) is not None:
        view.add([flow])
    if (save := ctx.master.addons.get("save")) is not None:
        save.save_flow(flow)
