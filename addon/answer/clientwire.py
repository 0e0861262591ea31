"""A spliced answer's body written to the client's own connection.

Through the endpoint, every event crossed mitmproxy once more: read from the endpoint's
connection, through its layers, framed and written to the client: about half of what
the proxy spent on an event. Once mitmproxy has sent the head and every byte it was given
of the body, the rest can go to the client's connection from the splice itself, each
write framed as the chunk mitmproxy would have made of it; the answer's end is still the
endpoint's close, after which mitmproxy writes the body's last chunk as before. Only
where nothing else reads the body on its way (surface/clientwire.py says where).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol


class ClientWire:
    """The client's connection, as mitmproxy writes a streamed response's body to it."""

    def __init__(
        self, writer: asyncio.StreamWriter, chunked: bool, activity: Callable[[], None]
    ) -> None:
        """`chunked`: the client's head says so; `activity()` tells mitmproxy the
        connection is in use (it closes one idle for its `tcp_timeout`)."""
        self._writer = writer
        self._transport = writer.transport
        self._chunked = chunked
        self._activity = activity

    def write(self, data: bytes) -> None:
        if data and not self._transport.is_closing():
            self._activity()
            self._writer.write(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)

    def backed_up(self) -> bool:
        transport = self._transport
        return transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1]

    async def drain(self) -> None:
        await self._writer.drain()


class Handing(Protocol):
    """What hands the body over: the endpoint's side of the answer."""

    fed: int  # body bytes written to mitmproxy so far
    ended: bool
    wire: ClientWire | None


def hand_over(
    answer: Handing, wire: ClientWire, response: Any, handed: Callable[[], None]
) -> Callable[[bytes], bytes]:
    """A `stream` for mitmproxy's response: it passes each piece of the body on, and once
    mitmproxy has been given all that was written to it, the answer writes on to `wire`
    (the piece passed now goes out first: mitmproxy sends it before anything else runs),
    and `handed()` is told."""
    seen = 0

    def stream(data: bytes) -> bytes:
        nonlocal seen
        seen += len(data)
        if seen == answer.fed and not answer.ended and answer.wire is None:
            answer.wire = wire
            response.stream = True  # nothing more to pass on
            handed()
        return data

    return stream
