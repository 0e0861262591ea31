"""A minimal streaming HTTP/1.1 client for the upstream legs, on h11 and an asyncio protocol.

httpx would do, but a leg sits on the per-token hot path and must be closed the instant
a handoff is decided; an asyncio protocol with h11 framing costs a fraction of httpx per
read, can hand each read to its consumer in the callback that received it (`push`: no
task woken per token), and closing the transport is all it takes for llama-server to
free the slot.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11

from watchers.listeners import port_of

# What a connection holds unread before it stops reading from the socket (as asyncio's
# StreamReader does at twice its 64 KiB limit): a slow consumer slows the server.
HELD_UNREAD = 2 * 65536


class UpstreamError(Exception):
    """The upstream could not be reached or broke the HTTP exchange."""


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

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class ChunkedBody:
    """Decodes a chunked body in bulk: one pass per read, not one Python event per chunk
    (llama-server sends every token as its own chunk)."""

    def __init__(self) -> None:
        self._buffer = b""
        self._left = 0  # bytes of chunk data still to come
        self._crlf = False  # a chunk's closing CRLF still to come
        self.complete = False

    def feed(self, data: bytes) -> bytes:
        if not (self._buffer or self._left or self._crlf) and (whole := _one_chunk(data)):
            return whole  # a server writing each token as its own chunk, read as written
        buffer = self._buffer + data if self._buffer else data
        out: list[bytes] = []
        pos, end = 0, len(buffer)
        while pos < end and not self.complete:
            if self._left:
                take = min(self._left, end - pos)
                out.append(buffer[pos : pos + take])
                pos += take
                self._left -= take
                self._crlf = not self._left
            elif self._crlf:
                if end - pos < 2:
                    break
                if buffer[pos : pos + 2] != b"\r\n":
                    raise UpstreamError("broken HTTP from upstream: bad chunk terminator")
                pos += 2
                self._crlf = False
            else:
                eol = buffer.find(b"\r\n", pos)
                if eol < 0:
                    if end - pos > 1024:
                        raise UpstreamError("broken HTTP from upstream: chunk header too long")
                    break
                try:
                    size = int(buffer[pos:eol].split(b";", 1)[0], 16)
                except ValueError:
                    raise UpstreamError("broken HTTP from upstream: bad chunk size") from None
                pos = eol + 2
                if size == 0:
                    self.complete = True  # trailers, if any, are of no interest
                self._left = size
        self._buffer = buffer[pos:]
        return b"".join(out)


def _one_chunk(data: bytes) -> bytes | None:
    """The data of `data` when it is exactly one whole chunk with data, `<hex>\\r\\n` and
    its data and CRLF; None for anything else (for the general reading)."""
    eol = data.find(b"\r\n", 0, 18)
    if eol < 1 or not data.endswith(b"\r\n"):
        return None
    try:
        size = int(data[:eol], 16)
    except ValueError:
        return None
    return data[eol + 2 : -2] if size and len(data) == eol + 4 + size else None


class LengthBody:
    def __init__(self, length: int | None) -> None:
        self._left = length
        self.until_close = length is None
        self.complete = length == 0

    def feed(self, data: bytes) -> bytes:
        if self._left is None:  # the body ends when the connection does
            return data
        data = data[: self._left]
        self._left -= len(data)
        self.complete = not self._left
        return data


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
    try:
        async with asyncio.timeout(connect_timeout):  # no task of its own, as wait_for makes
            transport, connection = await asyncio.get_running_loop().create_connection(
                Connection, upstream.host, upstream.port, ssl=upstream.tls or None
            )
    except (OSError, TimeoutError) as exc:
        raise UpstreamError(f"cannot connect to {upstream.url}: {exc!r}") from exc
    conn = h11.Connection(h11.CLIENT)
    request = h11.Request(method="POST", target=path, headers=sent_headers(upstream, body, headers))
    try:
        transport.write(
            conn.send(request) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
        )
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
        transport.abort()
        raise UpstreamError(f"{upstream.url} {_before_response(exc)}") from exc
    except BaseException:
        transport.abort()
        raise
