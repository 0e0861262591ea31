"""The in-process connection mitmproxy opens to the splice endpoint (addon/answer/inprocess.py),
against what a loopback socket gives: bytes in order each way, neither side's write seen
by the other in the same callback, a close seen by both, and a reader that stops reading
pausing the writer. The addon's own use of it, in a real mitmdump, is checked in
test_splice.py (the status says how mitmproxy reached the endpoint)."""

from __future__ import annotations

import asyncio

import pytest

from addon.answer import inprocess


class Recording(asyncio.Protocol):
    def __init__(self) -> None:
        self.received: list[bytes] = []
        self.events: list[str] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.events.append("made")

    def data_received(self, data: bytes) -> None:
        self.received.append(data)

    def eof_received(self) -> bool:
        self.events.append("eof")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.events.append(f"lost {exc!r}")

    def pause_writing(self) -> None:
        self.events.append("pause")

    def resume_writing(self) -> None:
        self.events.append("resume")


def test_bytes_go_both_ways_in_order_and_never_in_the_writers_own_callback() -> None:
    async def run() -> None:
        protocol = Recording()
        reader, writer = inprocess.connect(protocol, ("127.0.0.1", 9))
        assert protocol.events == ["made"] and protocol.transport is not None
        writer.write(b"POST / HTTP/1.1\r\n")
        writer.write(b"\r\n")
        assert protocol.received == []  # as from a socket: in a callback of its own
        await asyncio.sleep(0)
        assert b"".join(protocol.received) == b"POST / HTTP/1.1\r\n\r\n"
        protocol.transport.write(b"HTTP/1.1 200 OK\r\n")
        protocol.transport.write(b"\r\n")
        assert await reader.readexactly(19) == b"HTTP/1.1 200 OK\r\n\r\n"
        assert writer.get_extra_info("peername") == ("127.0.0.1", 9)
        await writer.drain()

    asyncio.run(run())


def test_a_close_from_either_side_is_seen_by_both() -> None:
    async def run() -> None:
        protocol = Recording()
        reader, writer = inprocess.connect(protocol, ("127.0.0.1", 9))
        writer.write(b"last words")
        writer.close()  # mitmproxy closing its server connection: the client left
        assert writer.is_closing() and "lost None" not in protocol.events
        for _ in range(3):
            await asyncio.sleep(0)
        assert protocol.received == [b"last words"] and protocol.events[-1] == "lost None"
        assert await reader.read() == b""
        assert protocol.transport is not None and protocol.transport.is_closing()

        protocol = Recording()
        reader, writer = inprocess.connect(protocol, ("127.0.0.1", 9))
        assert protocol.transport is not None
        protocol.transport.write(b"the answer")
        protocol.transport.close()  # the endpoint ending the connection
        protocol.transport.write(b"after the close")  # dropped, as a closed socket's
        assert await reader.read() == b"the answer"
        await asyncio.sleep(0)
        assert protocol.events == ["made", "lost None"]

        protocol = Recording()
        reader, writer = inprocess.connect(protocol, ("127.0.0.1", 9))
        writer.write_eof()  # a half close: the protocol says whether it stays open
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert protocol.events == ["made", "eof", "lost None"]
        assert await reader.read() == b""

    asyncio.run(run())


def test_a_protocol_that_fails_ends_its_connection() -> None:
    class Failing(Recording):
        def data_received(self, data: bytes) -> None:
            raise RuntimeError("broken")

    async def run() -> None:
        protocol = Failing()
        reader, writer = inprocess.connect(protocol, ("127.0.0.1", 9))
        writer.write(b"anything")
        # The opener sees the connection end (not a connection left open for good).
        assert await asyncio.wait_for(reader.read(), 5) == b""
        await asyncio.sleep(0)
        assert protocol.events == ["made", "lost None"]

    asyncio.run(run())


def test_a_reader_that_stops_reading_pauses_the_writer() -> None:
    async def run() -> None:
        protocol = Recording()
        reader, _ = inprocess.connect(protocol, ("127.0.0.1", 9))
        assert protocol.transport is not None
        for _ in range(64):
            protocol.transport.write(b"x" * 4096)  # 256 KiB, nothing read
        assert protocol.events == ["made", "pause"]
        assert len(await reader.read(1 << 20)) == 64 * 4096
        assert protocol.events == ["made", "pause", "resume"]

    asyncio.run(run())


def test_only_the_endpoints_address_is_taken(free_tcp_port: int) -> None:
    async def run() -> None:
        taken = ("127.0.0.1", free_tcp_port)
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        elsewhere = server.sockets[0].getsockname()[:2]
        undo = inprocess.open_connections_to(taken, lambda: inprocess.connect(Recording(), taken))
        again = inprocess.open_connections_to(
            taken, lambda: inprocess.connect(Recording(), taken)
        )  # a second endpoint taking the address over, as a restarted addon's would
        try:
            _, writer = await asyncio.open_connection(*taken)  # nothing listens there
            assert isinstance(writer, inprocess.StreamSide)
            reader, writer = await asyncio.open_connection(*elsewhere)
            assert isinstance(writer, asyncio.StreamWriter) and await reader.read() == b""
            writer.close()
            undo()  # the first one's undoing leaves the second's in place
            _, writer = await asyncio.open_connection(*taken)
            assert isinstance(writer, inprocess.StreamSide)
        finally:
            again()
        with pytest.raises(ConnectionRefusedError):  # given back: a socket's connect again
            await asyncio.open_connection(*taken)
        server.close()

    asyncio.run(run())
