"""A minimal streaming HTTP/1.1 client for the upstream legs, on h11 and asyncio streams.

httpx would do, but a leg sits on the per-token hot path and must be closed the instant
a handoff is decided; plain streams with h11 framing cost a fraction of httpx per read
and closing the transport is all it takes for llama-server to free the slot.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11

READ_SIZE = 65536


class UpstreamError(Exception):
    """The upstream could not be reached or broke the HTTP exchange."""


@dataclass(frozen=True)
class Upstream:
    """An OpenAI-compatible server: scheme, host and port, e.g. http://127.0.0.1:8082."""

    url: str

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        parts = urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)

    @property
    def authority(self) -> str:
        return urlsplit(self.url).netloc

    @property
    def tls(self) -> bool:
        return urlsplit(self.url).scheme == "https"


class Response:
    """A response whose head has arrived; iterate `body()` for the rest."""

    def __init__(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        head: h11.Response,
    ) -> None:
        self._conn = conn
        self._reader = reader
        self._writer = writer
        self.status = head.status_code
        self.headers = [(k.decode(), v.decode("latin-1")) for k, v in head.headers]

    async def body(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; ends at the end of the message, raises UpstreamError
        when the connection drops first."""
        conn = self._conn
        while True:
            try:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await self._reader.read(READ_SIZE))
                    continue
            except (ConnectionError, OSError) as exc:
                raise UpstreamError(f"connection lost: {exc!r}") from exc
            except h11.RemoteProtocolError as exc:
                raise UpstreamError(f"broken HTTP from upstream: {exc}") from exc
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return
            elif isinstance(event, h11.ConnectionClosed):
                raise UpstreamError("connection closed mid-body")
            else:
                raise UpstreamError(f"unexpected HTTP event {type(event).__name__}")

    async def read_all(self, limit: int = 16 * 1024 * 1024) -> bytes:
        parts: list[bytes] = []
        size = 0
        async for data in self.body():
            parts.append(data)
            size += len(data)
            if size > limit:
                raise UpstreamError(f"response body over {limit} bytes")
        return b"".join(parts)

    def close(self) -> None:
        """Drop the connection at once; the server sees the client go and stops work."""
        self._writer.transport.abort()


async def post(
    upstream: Upstream,
    path: str,
    body: bytes,
    headers: list[tuple[str, str]],
    connect_timeout: float = 5.0,
) -> Response:
    """Send a POST and wait for the response head."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(upstream.host, upstream.port, ssl=upstream.tls or None),
            connect_timeout,
        )
    except (OSError, TimeoutError) as exc:
        raise UpstreamError(f"cannot connect to {upstream.url}: {exc!r}") from exc
    conn = h11.Connection(h11.CLIENT)
    request = h11.Request(
        method="POST",
        target=path,
        headers=[
            ("host", upstream.authority),
            ("content-length", str(len(body))),
            ("accept-encoding", "identity"),
            ("connection", "close"),
            *headers,
        ],
    )
    try:
        writer.write(
            conn.send(request) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
        )
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(READ_SIZE)
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Response):
                return Response(conn, reader, writer, event)
            if isinstance(event, h11.InformationalResponse):
                continue
            raise UpstreamError(f"connection closed before a response from {upstream.url}")
    except (OSError, h11.RemoteProtocolError) as exc:
        writer.transport.abort()
        raise UpstreamError(f"{upstream.url} failed before its response: {exc!r}") from exc
    except BaseException:
        writer.transport.abort()
        raise
