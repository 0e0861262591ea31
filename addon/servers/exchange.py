"""The record of one request the addon itself makes upstream: a leg of an answer (what
its server was asked, what came back up to the cut, why it ended) or a question (`/props`,
`/v1/models`, `/tokenize`, the prefill probe). `surface/flows.py` makes flows of them;
`RecordingTransport` makes them of a client's questions."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from addon.servers.credentials import redacted
from addon.servers.kept import KeptConnections
from watchers.listeners import port_of

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


class RecordingTransport(httpx.AsyncBaseTransport):
    """Keeps each question and its answer as an `Exchange` (see exchange.py)."""

    def __init__(self, record: Callable[[Exchange], None], kept_per_server: int) -> None:
        self._inner = KeptConnections(kept_per_server)
        self._record = record

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        exchange = Exchange(
            f"{url.scheme}://{url.host}:{port_of(str(url))}", request.method, url.raw_path.decode(),
            redacted(request.headers.raw), await request.aread(),
            purpose="question",
        )  # fmt: skip
        try:
            # (a kept connection its server closed meanwhile is asked on again by the
            # transport itself: servers/kept.py)
            response = await self._inner.handle_async_request(request)
            body = await response.aread()
        except Exception as exc:
            exchange.end("failed", repr(exc))
            self._record(exchange)
            raise
        exchange.respond(response.status_code, list(response.headers.raw))
        exchange.keep(body)
        exchange.end("complete")
        self._record(exchange)
        return httpx.Response(
            response.status_code, headers=response.headers, content=body,
            extensions=response.extensions,
        )  # fmt: skip

    async def aclose(self) -> None:
        await self._inner.aclose()
