"""A minimal streaming HTTP/1.1 client for the upstream legs, on h11 and an asyncio protocol.

httpx would do, but a leg sits on the per-token hot path and must be closed the instant
a handoff is decided; an asyncio protocol with h11 framing costs a fraction of httpx per
read, can hand each read to its consumer in the callback that received it (`push`: no
task woken per token), and closing the transport is all it takes for llama-server to
free the slot.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11

from addon.servers.framing import ChunkedBody, LengthBody, UpstreamError
from addon.servers.tls import tls_context
from watchers.listeners import port_of

# What a connection holds unread before it stops reading from the socket (as asyncio's
# StreamReader does at twice its 64 KiB limit): a slow consumer slows the server.
HELD_UNREAD = 2 * 65536


class Unreachable(UpstreamError):
    """No connection could be made: nothing listens there (yet), or its TLS failed."""

    def __init__(self, url: str, exc: OSError | TimeoutError) -> None:
        self.tls = isinstance(exc, ssl.SSLError)
        if isinstance(exc, ssl.SSLCertVerificationError):
            self.reason = f"TLS: {exc.verify_message}"
        elif isinstance(exc, ssl.SSLError):
            self.reason = f"TLS: {exc.reason or exc}"
        elif isinstance(exc, ConnectionRefusedError):
            self.reason = "refused"
        elif isinstance(exc, TimeoutError):
            self.reason = "timed out"
        else:
            self.reason = exc.strerror or type(exc).__name__
        super().__init__(f"cannot connect to {url}: {self.reason}")


def _before_response(exc: OSError | h11.RemoteProtocolError) -> str:
    """What went wrong before a response, in words (h11 says "can't handle event type
    ConnectionClosed when role=SERVER and state=SEND_RESPONSE" for a closed connection)."""
    if isinstance(exc, ConnectionResetError):
        return "reset the connection before its response"
    if isinstance(exc, h11.RemoteProtocolError):
        if "ConnectionClosed" in str(exc):
            return "closed the connection before its response"
        return f"broke HTTP before its response ({exc})"
    return f"failed before its response ({exc.strerror or exc!r})"


@dataclass(frozen=True)
class Upstream:
    """An OpenAI-compatible server: scheme, host and port, e.g. http://127.0.0.1:8082."""

    url: str

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        return port_of(self.url)

    @property
    def authority(self) -> str:
        return urlsplit(self.url).netloc

    @property
    def tls(self) -> bool:
        return urlsplit(self.url).scheme == "https"


class Connection(asyncio.Protocol):
    """One upstream connection's bytes: read in turn (`read`), or handed to a sink in the
    callback that received them (`sink`), whichever its reader chose."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.sink: Callable[[bytes], None] | None = None
        self.on_end: Callable[[OSError | None], None] | None = None  # with a sink
        self._unread: deque[bytes] = deque()
        self._unread_bytes = 0
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._ended = False
        self._error: OSError | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.sink is not None:
            self.sink(data)
            return
        self._unread.append(data)
        self._unread_bytes += len(data)
        if self._unread_bytes > HELD_UNREAD:
            self.pause()
        self._wake()

    def eof_received(self) -> bool:
        self._end(None)
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(exc if isinstance(exc, OSError) or exc is None else OSError(str(exc)))

    def _end(self, error: OSError | None) -> None:
        if self._ended:
            return
        self._ended, self._error = True, error
        if self.on_end is not None:
            self.on_end(error)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def take_unread(self) -> tuple[list[bytes], bool, OSError | None]:
        """What arrived and was not read yet, whether the connection ended, and how."""
        unread = list(self._unread)
        self._unread.clear()
        self._unread_bytes = 0
        return unread, self._ended, self._error

    async def read(self) -> bytes:
        """The next bytes; b"" once the server closed the connection. Raises the
        connection's error when it broke."""
        while not self._unread:
            if self._ended:
                if self._error is not None:
                    raise self._error
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._unread.popleft()
        self._unread_bytes -= len(data)
        if self._paused and self._unread_bytes <= HELD_UNREAD // 2:
            self.resume()
        return data

    def pause(self) -> None:
        if self.transport is not None and not self._paused:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and self._paused:
            self._paused = False
            self.transport.resume_reading()

    @property
    def open(self) -> bool:
        """Whether it can carry another request: neither side ended it, nothing unread."""
        transport = self.transport
        return not (self._ended or self._unread or transport is None or transport.is_closing())

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class Response:
    """A response whose head has arrived; its body comes by `body()` or by `push`."""

    def __init__(self, conn: h11.Connection, connection: Connection, head: h11.Response) -> None:
        self._connection = connection
        self.tap: Callable[[bytes], None] | None = None  # when set, is given the body as read
        self.status = head.status_code
        self.reason = head.reason
        self.headers = head.headers.raw_items()  # as the server wrote them
        fields = {k.lower().decode(): v.lower().decode("latin-1") for k, v in self.headers}
        self._initial = conn.trailing_data[0]
        self._keeps_alive = head.http_version == b"1.1" and "close" not in fields.get(
            "connection", ""
        )
        if "chunked" in fields.get("transfer-encoding", ""):
            self._decoder: ChunkedBody | LengthBody = ChunkedBody()
        elif "content-length" in fields:
            self._decoder = LengthBody(int(fields["content-length"]))
        elif head.status_code in (204, 304):
            self._decoder = LengthBody(0)
        else:
            self._decoder = LengthBody(None)

    async def body(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; ends at the end of the message, raises UpstreamError
        when the connection drops first."""
        decoder, data = self._decoder, self._initial
        while True:
            if data and (out := decoder.feed(data)):
                if self.tap is not None:
                    self.tap(out)
                yield out
            if decoder.complete:
                return
            try:
                data = await self._connection.read()
            except OSError as exc:
                raise self._cut_short(exc) from exc
            if not data:
                if (why := self._cut_short(None)) is None:
                    return
                raise why

    def _cut_short(self, error: OSError | None) -> UpstreamError | None:
        """Why the body ended when the connection did (with `error`, or closed by the
        server); None where that is how it ends (a body that runs to the close)."""
        if error is not None:
            return UpstreamError(f"connection lost: {error!r}")
        if isinstance(self._decoder, LengthBody) and self._decoder.until_close:
            return None
        return UpstreamError("connection closed mid-body")

    def push(
        self, on_body: Callable[[bytes], None], on_end: Callable[[UpstreamError | None], None]
    ) -> None:
        """From now on give each read's body bytes to `on_body` in the callback that
        received them, then call `on_end` once: None at the end of the message, else why
        the connection dropped first. Either may be called before this returns."""
        decoder, connection = self._decoder, self._connection
        ended = False

        def end(error: UpstreamError | None) -> None:
            nonlocal ended
            if not ended:
                ended = True
                connection.sink = connection.on_end = None
                on_end(error)

        def received(data: bytes) -> None:
            if ended:
                return
            try:
                out = decoder.feed(data)
            except UpstreamError as exc:
                connection.close()
                end(exc)
                return
            if out:
                if self.tap is not None:
                    self.tap(out)
                on_body(out)
            if decoder.complete:
                end(None)

        def lost(error: OSError | None) -> None:
            end(self._cut_short(error))

        unread, over, error = connection.take_unread()
        connection.sink, connection.on_end = received, lost
        for data in [self._initial, *unread]:
            if data:
                received(data)
        if not decoder.complete and over:
            lost(error)
        elif decoder.complete:
            end(None)

    def pause(self) -> None:
        """Stop reading from the server until `resume` (its socket fills; it slows)."""
        self._connection.pause()

    def resume(self) -> None:
        self._connection.resume()

    async def read_all(self, limit: int = 16 * 1024 * 1024) -> bytes:
        parts: list[bytes] = []
        size = 0
        async for data in self.body():
            parts.append(data)
            size += len(data)
            if size > limit:
                raise UpstreamError(f"response body over {limit} bytes")
        return b"".join(parts)

    @property
    def reusable(self) -> bool:
        """Whether its connection can carry another request: its body, of a stated length,
        read whole and nothing after it (a chunked one's last CRLF may still be on its
        way), and neither side ended or closes it."""
        decoder = self._decoder
        whole = isinstance(decoder, LengthBody) and decoder.complete and not decoder.until_close
        whole = whole and not decoder.overrun
        return whole and self._keeps_alive and self._connection.open

    def close(self) -> None:
        """Drop the connection at once; the server sees the client go and stops work."""
        self._connection.close()


def sent_headers(
    upstream: Upstream, body: bytes, headers: list[tuple[bytes, bytes]]
) -> list[tuple[bytes, bytes]]:
    return [
        (b"host", upstream.authority.encode()),
        (b"content-length", str(len(body)).encode()),
        (b"accept-encoding", b"identity"),
        *headers,
    ]


async def post(
    upstream: Upstream,
    path: str,
    body: bytes,
    headers: list[tuple[bytes, bytes]],
    connect_timeout: float = 5.0,
) -> Response:
    """Send a POST and wait for the response head."""
    request = h11.Request(method="POST", target=path, headers=sent_headers(upstream, body, headers))
    return await send(await connect(upstream, connect_timeout), upstream, request, body)


def get_request(upstream: Upstream, path: str) -> h11.Request:
    headers = [(b"host", upstream.authority.encode()), (b"accept-encoding", b"identity")]
    return h11.Request(method="GET", target=path, headers=headers)


async def connect(upstream: Upstream, connect_timeout: float = 5.0) -> Connection:
    """A new connection to `upstream` (raises Unreachable)."""
    try:
        async with asyncio.timeout(connect_timeout):  # no task of its own, as wait_for makes
            _, connection = await asyncio.get_running_loop().create_connection(
                Connection,
                upstream.host,
                upstream.port,
                ssl=tls_context() if upstream.tls else None,
            )
    except (OSError, TimeoutError) as exc:
        raise Unreachable(upstream.url, exc) from exc
    return connection


async def send(
    connection: Connection, upstream: Upstream, request: h11.Request, body: bytes = b""
) -> Response:
    """Send a request on `connection` and wait for the response head (the connection is
    dropped when that fails)."""
    conn = h11.Connection(h11.CLIENT)
    try:
        sent = conn.send(request)
        if body:
            sent += conn.send(h11.Data(data=body))
        assert connection.transport is not None
        connection.transport.write(sent + conn.send(h11.EndOfMessage()))
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await connection.read())
                continue
            if isinstance(event, h11.Response):
                return Response(conn, connection, event)
            if isinstance(event, h11.InformationalResponse):
                continue
            raise UpstreamError(f"connection closed before a response from {upstream.url}")
    except (OSError, h11.RemoteProtocolError) as exc:
        connection.close()
        raise UpstreamError(f"{upstream.url} {_before_response(exc)}") from exc
    except BaseException:
        connection.close()
        raise
