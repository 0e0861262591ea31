"""A connection inside the process: asyncio.open_connection's two streams on one side, a
protocol on the other, each side's writes handed to the other in memory.

mitmproxy opens its server connections with asyncio.open_connection. The splice
endpoint's connection is opened this way (answer/endpoint.py): over loopback TCP, every
event of every spliced answer cost one send, one receive and one wake-up of the event
loop more than plain mitmdump's, the most of what the addon added per event. Only the
endpoint's own address is taken; a mitmproxy that opens connections another way gets the
loopback endpoint as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

StreamPair = tuple[asyncio.StreamReader, "StreamSide"]
log = logging.getLogger(__name__)
Opener = Callable[..., Awaitable[tuple[asyncio.StreamReader, Any]]]


def connect(
    protocol: asyncio.Protocol, peer: tuple[str, int], on_close: Callable[[], None] = lambda: None
) -> StreamPair:
    """The streams of a new connection to `protocol` (already made: its connection_made
    has been called), as open_connection gives them, for a server at `peer`; `on_close`
    is called once the opener has closed its writer."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(loop=loop)
    side = ProtocolSide(reader, protocol)
    reader.set_transport(_ReadPacing(protocol))  # type: ignore[arg-type]
    protocol.connection_made(side)
    return reader, StreamSide(side, protocol, peer, on_close)


def open_connections_to(
    address: tuple[str, int], accept: Callable[[], StreamPair]
) -> Callable[[], None]:
    """From now on asyncio.open_connection to `address` gives `accept()`'s streams; the
    returned callable undoes it. asyncio's own is wrapped once, for good: with no
    address taken the wrapper only passes each call on (no order of undoing can leave
    it calling itself)."""
    global _opened
    if _opened is None:
        _opened = asyncio.open_connection
        asyncio.open_connection = _open_connection  # type: ignore[assignment]
    _taken[address] = accept

    def undo() -> None:
        if _taken.get(address) is accept:
            del _taken[address]

    return undo


_taken: dict[tuple[str, int], Callable[[], StreamPair]] = {}  # address -> its streams
_opened: Opener | None = None  # asyncio's own


async def _open_connection(host: Any = None, port: Any = None, **kwargs: Any) -> Any:
    if (accept := _taken.get((host, port))) is not None:
        # As a connect would, it suspends first: mitmproxy (12) records the connection
        # as opening only after the task that opens it has.
        await asyncio.sleep(0)
        return accept()
    assert _opened is not None
    return await _opened(host, port, **kwargs)


class _ReadPacing:
    """What the stream reader pauses and resumes when the opener does not read: the
    protocol's writing, as a socket's full buffer would."""

    def __init__(self, protocol: asyncio.Protocol) -> None:
        self._protocol = protocol

    def pause_reading(self) -> None:
        self._protocol.pause_writing()

    def resume_reading(self) -> None:
        self._protocol.resume_writing()


class ProtocolSide(asyncio.Transport):
    """The protocol's transport: what it writes is the opener's to read."""

    def __init__(self, reader: asyncio.StreamReader, protocol: asyncio.Protocol) -> None:
        super().__init__()
        self._reader = reader
        self._protocol = protocol
        self._closed = False

    def write(self, data: bytes) -> None:
        if not self._closed and data:
            self._reader.feed_data(data)

    def is_closing(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Both ways, as a socket's close: the opener reads its end, and the protocol
        hears that the connection is lost, in a callback of its own."""
        if self._closed:
            return
        self._closed = True
        self._reader.feed_eof()
        asyncio.get_running_loop().call_soon(self._protocol.connection_lost, None)

    def abort(self) -> None:
        self.close()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class StreamSide:
    """The opener's writer, as far as a StreamWriter is used for a connection: what it
    writes reaches the protocol in a callback of its own, in order, as from a socket."""

    def __init__(
        self,
        side: ProtocolSide,
        protocol: asyncio.Protocol,
        peer: tuple[str, int],
        on_close: Callable[[], None],
    ) -> None:
        self._side = side
        self._protocol = protocol
        self._peer = peer
        self._on_close = on_close
        self._loop = asyncio.get_running_loop()
        self._closing = False

    def write(self, data: bytes) -> None:
        if not self._closing and data:
            self._loop.call_soon(self._deliver, data)

    def _deliver(self, data: bytes) -> None:
        if not self._side.is_closing():
            self._told(lambda: self._protocol.data_received(data))

    def write_eof(self) -> None:
        self._loop.call_soon(self._eof)

    def _eof(self) -> None:
        if not self._side.is_closing() and not self._told(self._protocol.eof_received):
            self._side.close()

    def _told(self, call: Callable[[], bool | None]) -> bool | None:
        try:
            return call()
        except Exception:  # as a socket transport does: logged, and the connection ends
            log.exception("the protocol of an in-process connection failed")
            self._side.close()
            return None

    def can_write_eof(self) -> bool:
        return True

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if not self._closing:
            self._closing = True
            self._loop.call_soon(self._side.close)
            self._on_close()

    async def wait_closed(self) -> None:
        return None

    async def drain(self) -> None:
        return None  # what it writes is taken at once

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "peername":
            return self._peer
        if name == "sockname":
            return ("127.0.0.1", 0)
        return default
