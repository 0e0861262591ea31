"""The splice endpoint: a loopback HTTP server inside mitmproxy's own event loop.

mitmproxy cannot feed an open response from an addon, so spliced flows are re-pointed
here. Each request carries a token naming its `Splice`; the endpoint writes its one
chunked response back to mitmproxy, which streams it to the client. Owning the response
lets the answer go on from another server after the first one is dropped. A splice
starts when its request arrives here: started in mitmproxy's request hook instead, its
first leg gained nothing measurable on the first token, and when hundreds of answers
were asked at once their servers wrote into the proxy while it was still taking the
requests (events queued there for up to a second, the first tokens 3x later).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from http import HTTPStatus

import h11

from addon.answer.splice import Splice
from addon.formats.wire import Header, framed

TOKEN_HEADER = "x-spillover-splice"
log = logging.getLogger(__name__)


class HttpClientStream:
    """A chunked HTTP/1.1 response written through h11 to one endpoint connection."""

    def __init__(self, conn: h11.Connection, writer: asyncio.StreamWriter) -> None:
        self._conn = conn
        self._writer = writer
        self._transport = writer.transport
        self._high_water = self._transport.get_write_buffer_limits()[1]
        self.started = False
        self.ended = False

    def start(self, status: int, headers: list[Header], reason: bytes = b"") -> None:
        self.started = True
        headers = framed(headers, (b"Transfer-Encoding", b"chunked"))  # as llama-server does
        head = h11.Response(status_code=status, headers=headers, reason=reason or _phrase(status))
        self._writer.write(_in_order(self._conn.send(head) or b"", headers))

    def write(self, data: bytes) -> None:
        if data and not self.ended:
            # Framed here: the hot path, where h11's own checks cost more than the write.
            # h11 keeps no count of a chunked body, so its state stays true for end().
            self._writer.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end(self, last: bytes = b"") -> None:
        if self.ended:
            return
        self.ended = True
        # One write: a client that hangs up right after [DONE] must not find the
        # terminating chunk still unsent (mitmproxy would drop the stored body).
        tail = self._conn.send(h11.Data(data=last)) if last else b""
        self._writer.write(tail + self._conn.send(h11.EndOfMessage()))

    def respond(self, status: int, headers: list[Header], body: bytes, reason: bytes = b"") -> None:
        self.started = self.ended = True
        head = h11.Response(
            status_code=status,
            headers=framed(headers, (b"Content-Length", str(len(body)).encode())),
            reason=reason or _phrase(status),
        )
        self._writer.write(
            self._conn.send(head) + self._conn.send(h11.Data(data=body))
            + self._conn.send(h11.EndOfMessage())
        )  # fmt: skip

    async def drain(self) -> None:
        await self._writer.drain()

    def backed_up(self) -> bool:
        return self._transport.get_write_buffer_size() > self._high_water


class SpliceEndpoint:
    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._waiting: dict[str, Splice] = {}  # by token, until its request arrives
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

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

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request = await _next_request(conn, reader)
                if request is None:
                    return
                token = dict(request.headers).get(TOKEN_HEADER.encode(), b"").decode()
                splice = self._waiting.pop(token, None)
                client = HttpClientStream(conn, writer)
                if splice is None:
                    client.respond(502, [(b"content-type", b"text/plain")], b"unknown splice\n")
                else:
                    run = asyncio.ensure_future(splice.run(client))
                    run.add_done_callback(_log_failure)
                    await _run_until_client_leaves(splice, run, client, reader)
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (ConnectionError, h11.ProtocolError) as exc:
            log.debug("splice endpoint connection ended: %r", exc)
        except asyncio.CancelledError:
            # mitmproxy is shutting down. The handler's task ends here: asyncio's stream
            # server would print a cancelled handler's traceback.
            pass
        finally:
            writer.transport.abort()


def _in_order(head: bytes, headers: list[Header]) -> bytes:
    """h11's response head with its Transfer-Encoding line where `headers` has it (h11
    writes it last), so the client reads the server's headers in the server's order."""
    lines = head.split(b"\r\n")
    framing = [i for i, line in enumerate(lines) if line.lower().startswith(b"transfer-encoding:")]
    names = [name.lower() for name, _ in headers]
    if len(framing) != 1 or b"transfer-encoding" not in names:
        return head
    line = lines.pop(framing[0])
    before = names[: names.index(b"transfer-encoding")]
    # After the line of the last header that comes before it (the status line if none).
    at = max((i for i, text in enumerate(lines[1:], 1) if _name(text) in before), default=0)
    lines.insert(at + 1, line)
    return b"\r\n".join(lines)


def _name(line: bytes) -> bytes:
    return line.split(b":", 1)[0].strip().lower()


def _phrase(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


async def _next_request(conn: h11.Connection, reader: asyncio.StreamReader) -> h11.Request | None:
    """Read one request and its body (the splice already holds the parsed body)."""
    request = None
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await reader.read(65536)
            conn.receive_data(data)
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.EndOfMessage):
            return request
        elif isinstance(event, h11.ConnectionClosed):
            return None


def _log_failure(run: asyncio.Future[None]) -> None:
    if not run.cancelled() and (exc := run.exception()) is not None:
        log.debug("splice ended by %r", exc)  # told to the client where it has one


async def _run_until_client_leaves(
    splice: Splice,
    run: asyncio.Future[None],
    client: HttpClientStream,
    reader: asyncio.StreamReader,
) -> None:
    """Wait for the splice; if mitmproxy closes this connection (the client left), cancel
    it."""
    gone = asyncio.ensure_future(reader.read(1))
    try:
        await asyncio.wait({run, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        client_left = not run.done()
        if client_left:
            splice.cancel()
        gone.cancel()
        await asyncio.wait({run, gone})  # both settled before the connection is reused
    if client_left or run.cancelled():
        # Either way the client is gone: mitmproxy's error hook may cancel the splice
        # before this connection's close is seen.
        raise ConnectionError("client left")
    if (exc := run.exception()) is not None:
        # Fail safe: whatever broke, the client gets a readable end, not a cut connection.
        log.error("splice failed", exc_info=exc)
        if client.started:
            client.end(splice.dialect.error_end(f"spillover failed: {exc!r}"))
        else:
            client.respond(502, [(b"content-type", b"text/plain")], b"spillover failed\n")
