"""The splice endpoint: an HTTP server inside mitmproxy's own event loop.

mitmproxy cannot feed an open response from an addon, so spliced flows are re-pointed
here. Each request carries a token naming its `Splice`; the endpoint writes its one
chunked response back to mitmproxy, which streams it to the client. Owning the response
lets the answer go on from another server after the first one is dropped. A splice
starts when its request arrives here: started in mitmproxy's request hook instead, its
first leg gained nothing measurable on the first token, and when hundreds of answers
were asked at once their servers wrote into the proxy while it was still taking the
requests (events queued there for up to a second, the first tokens 3x later).
mitmproxy's connections to it are made in process (answer/inprocess.py); it listens on
a loopback port as well, for a mitmproxy that connects another way.

A streamed answer's body ends with its connection, not with a chunked framing that
mitmproxy would undo event by event (h11's chunk reader: 3.6 against 1.3 us an event);
its head says where the client's `Transfer-Encoding: chunked` stands, and the addon's
response-headers hook puts it there (`as_the_client_reads`), so the client's bytes are
what they were. A closed connection cannot say that an answer was cut: the endpoint
always ends an answer readably (an in-band error where it broke), never by a cut.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from http import HTTPStatus

import h11

from addon.answer import inprocess
from addon.answer.clientwire import ClientWire
from addon.answer.splice import Splice
from addon.formats.wire import Header, framed

TOKEN_HEADER = "x-spillover-splice"
# Stands in the endpoint's head where the client's Transfer-Encoding goes.
FRAMING_HEADER = b"X-Spillover-Client-Framing"
log = logging.getLogger(__name__)


class HttpClientStream:
    """The HTTP/1.1 response of one endpoint connection: a streamed one runs until the
    connection closes; a whole one (`respond`) is written through h11 with its length."""

    def __init__(self, conn: h11.Connection, connection: _Connection) -> None:
        self._conn = conn
        self._connection = connection
        self._transport = connection.transport
        self.started = False
        self.ended = False
        self.fed = 0  # bytes of a streamed body written to mitmproxy
        self.wire: ClientWire | None = None  # where the body goes on, once handed over

    def start(self, status: int, headers: list[Header], reason: bytes = b"") -> None:
        """The head of a streamed answer; the client's is chunked, as llama-server's is,
        with the framing where the server had it."""
        self.started = True
        # The marker's value: the name of the line it stands for, spelled as the server
        # spelled it (uvicorn writes it lowercase, llama-server capitalized).
        spelled = next((k for k, _ in headers if k.lower() == b"transfer-encoding"), None)
        marker = (FRAMING_HEADER, spelled or b"Transfer-Encoding")
        lines = [b"HTTP/1.1 %d %s" % (status, reason or _phrase(status))]
        lines += [b"%s: %s" % field for field in framed(headers, marker)]
        self._transport.write(b"\r\n".join(lines) + b"\r\n\r\n")

    def write(self, data: bytes) -> None:
        if not data or self.ended:
            return
        if self.wire is not None:
            self.wire.write(data)
        else:
            self.fed += len(data)
            self._transport.write(data)

    def end(self, last: bytes = b"") -> None:
        """The answer's last bytes, and its end: the connection's close, which mitmproxy
        reads after them, in the same pass where nothing waits in between."""
        if self.ended:
            return
        self.write(last)
        self.ended = True
        self._transport.close()

    def respond(self, status: int, headers: list[Header], body: bytes, reason: bytes = b"") -> None:
        self.started = self.ended = True
        head = h11.Response(
            status_code=status,
            headers=framed(headers, (b"Content-Length", str(len(body)).encode())),
            reason=reason or _phrase(status),
        )
        self._transport.write(
            self._conn.send(head) + self._conn.send(h11.Data(data=body))
            + self._conn.send(h11.EndOfMessage())
        )  # fmt: skip

    async def drain(self) -> None:
        if self.wire is not None:
            await self.wire.drain()
        await self._connection.drain()  # (and raises once mitmproxy let the answer go)

    def backed_up(self) -> bool:
        return self._connection.paused or (self.wire is not None and self.wire.backed_up())


class SpliceEndpoint:
    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._waiting: dict[str, Splice] = {}  # by token, until its request arrives
        self.port = 0
        self._in_process: Callable[[], None] | None = None  # undoes it
        self.connections = {"in process": 0, "over loopback TCP": 0}  # mitmproxy's, made
        self.open: set[_Connection] = set()  # not yet closed by mitmproxy
        self.handed_over = 0  # answers whose body went on to the client's connection

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._over_tcp, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        # mitmproxy's connections to it are made in process (answer/inprocess.py); the
        # server stays for a mitmproxy that connects another way.
        self._in_process = inprocess.open_connections_to(self.address, self._accept)

    async def stop(self) -> None:
        if self._in_process is not None:
            self._in_process()
            self._in_process = None
        if self._server is not None:
            self._server.close()
            self._server = None

    @property
    def address(self) -> tuple[str, int]:
        return "127.0.0.1", self.port

    def _accept(self) -> inprocess.StreamPair:
        self.connections["in process"] += 1
        connection = _Connection(self._waiting)
        self.open.add(connection)
        return inprocess.connect(connection, self.address, lambda: self.open.discard(connection))

    def _over_tcp(self) -> _Connection:
        self.connections["over loopback TCP"] += 1
        return _Connection(self._waiting, self.open)

    def status(self) -> dict[str, int]:
        """How mitmproxy's connections to the endpoint were made (a mitmproxy that no
        longer opens them with asyncio.open_connection shows here, still carrying), how
        many mitmproxy holds open now (in process, until mitmproxy closes its side; over
        TCP, until the connection is lost), and how many answers went on to their
        client's connection (answer/clientwire.py)."""
        return {**self.connections, "open": len(self.open), "handed over": self.handed_over}

    def handed(self) -> None:
        self.handed_over += 1

    @property
    def running(self) -> bool:
        return self._server is not None

    def expect(self, splice: Splice) -> str:
        """A splice to run when its request arrives; the returned token goes in the
        re-pointed request, whose connection gets what the splice writes."""
        token = secrets.token_hex(16)
        self._waiting[token] = splice
        return token

    def forget(self, token: str) -> bool:
        """Drop a splice whose request never arrived (its flow ended before: killed, or
        answered by another addon); False if it had arrived."""
        return self._waiting.pop(token, None) is not None


class _Connection(asyncio.Protocol):
    """One connection from mitmproxy: its requests in turn, each answered by the splice
    its token names. A protocol, not a stream handler: no task per connection, and the
    client leaving is its connection's loss, not a read waited for."""

    transport: asyncio.Transport  # once made

    def __init__(self, waiting: dict[str, Splice], open_: set[_Connection] | None = None) -> None:
        self._waiting = waiting
        self._open = open_  # where it counts itself while open (over TCP)
        self._conn = h11.Connection(h11.SERVER)
        self._token = b""  # the token of the request being read
        self._answering: tuple[asyncio.Future[None], Splice, HttpClientStream] | None = None
        self._lost = False
        self._writable: asyncio.Future[None] | None = None  # while writing is paused

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self._open is not None:
            self._open.add(self)

    def data_received(self, data: bytes) -> None:
        self._conn.receive_data(data)
        if self._answering is None:
            self._next()  # else kept until the answer is over (mitmproxy waits for it)

    def eof_received(self) -> bool:
        return False  # mitmproxy closed the connection: the client left (or is done)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if self._open is not None:
            self._open.discard(self)
        self.resume_writing()  # a drain waiting finds the connection lost
        if self._answering is None:
            return
        run, splice, client = self._answering
        if not (run.done() or client.ended):  # (once it ended, what is left is its own)
            splice.cancel()

    @property
    def paused(self) -> bool:
        """Whether mitmproxy has more of the answer unread than it should have: the
        splice stops reading its server until it is read."""
        return self._writable is not None

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if (waiter := self._writable) is not None and not waiter.done():
            waiter.set_result(None)
        self._writable = None

    async def drain(self) -> None:
        if self._writable is not None and not self._lost:
            await asyncio.shield(self._writable)
        if self._lost or self.transport.is_closing():
            raise ConnectionResetError("the splice endpoint's connection closed")

    def _next(self) -> None:
        """Read on to the end of the next request, and answer it."""
        try:
            while (event := self._conn.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
                if isinstance(event, h11.Request):
                    self._token = dict(event.headers).get(TOKEN_HEADER.encode(), b"")
                elif isinstance(event, h11.EndOfMessage):
                    self._answer(self._waiting.pop(self._token.decode(), None))
                    return
        except h11.ProtocolError as exc:
            log.debug("splice endpoint connection ended: %r", exc)
            self.transport.abort()

    def _answer(self, splice: Splice | None) -> None:
        client = HttpClientStream(self._conn, self)
        if splice is None:
            client.respond(502, [(b"content-type", b"text/plain")], b"unknown splice\n")
            self._served()
            return
        run = asyncio.ensure_future(splice.run(client))
        self._answering = (run, splice, client)
        run.add_done_callback(lambda _: self._ran(run, splice, client))

    def _ran(self, run: asyncio.Future[None], splice: Splice, client: HttpClientStream) -> None:
        self._answering = None
        exc = None if run.cancelled() else run.exception()
        if client.ended:  # the answer is out whole; what broke after it is only logged
            if exc is not None:
                log.error("splice failed after its answer ended", exc_info=exc)
            self._served()
            return
        if self._lost or run.cancelled():
            # Either way the client is gone: mitmproxy's error hook may cancel the splice
            # before this connection's close is seen.
            if exc is not None:
                log.debug("splice ended by %r", exc)  # told to the client where it has one
            self.transport.abort()
            return
        if exc is not None:
            # Fail safe: whatever broke, the client gets a readable end, not a cut connection.
            log.error("splice failed", exc_info=exc)
            if client.started:
                client.end(splice.dialect.error_end(f"spillover failed: {exc!r}"))
            else:
                client.respond(502, [(b"content-type", b"text/plain")], b"spillover failed\n")
        self._served()

    def _served(self) -> None:
        """The answer is out: the connection takes the next request, where it may."""
        if self.transport.is_closing():
            return  # a streamed answer, ended by its connection's close (flushed first)
        conn = self._conn
        if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
            self.transport.abort()
            return
        conn.start_next_cycle()
        self._next()


def as_the_client_reads(fields: tuple[Header, ...]) -> tuple[Header, ...] | None:
    """A streamed answer's head as its client reads it: chunked, where the endpoint's
    head marks the place; None for a head without the mark (a whole answer)."""
    marker = FRAMING_HEADER.lower()
    if not any(name.lower() == marker for name, _ in fields):
        return None
    return tuple(
        (value, b"chunked") if name.lower() == marker else (name, value) for name, value in fields
    )


def _phrase(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""
