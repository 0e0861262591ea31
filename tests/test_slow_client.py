"""A client that stops reading: the proxy reads its server only as fast as the client
reads (each leg's reads are pumped in the callback that receives them, so nothing but
the client's own connection holds them back).

The server is the benchmarks' stand-in (scripts/testbed/sse_source.py): no real server
here writes tens of MiB of answer on demand as fast as its socket takes them."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from addon.servers.framing import ChunkedBody
from scripts.bench.paced import resident_mib
from scripts.bench.splice import MESSAGES, SseSource
from scripts.parts.processes import running
from scripts.testbed.mitm import Mitmdump

EVENTS = 300_000  # about 50 MiB of chunks
STALL_S = 3.0


@pytest.fixture
def source(server_logs: Path) -> Iterator[SseSource]:
    with running(SseSource(log_dir=server_logs)) as (started,):
        yield started


async def read_after_a_stall(port: int, pid: int) -> tuple[int, float, float]:
    """(events read, the proxy's resident MiB before the stall, and at its end)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps({"stream": True, "max_tokens": EVENTS, "messages": MESSAGES}).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    await reader.readuntil(b"\r\n\r\n")
    before = resident_mib([pid])
    await asyncio.sleep(STALL_S)  # reads nothing: the socket fills
    stalled = resident_mib([pid])
    body, events, pending = ChunkedBody(), 0, b""
    while not body.complete:
        data = await reader.read(1 << 20)
        if not data:
            break
        pending += body.feed(data)
        end = pending.rfind(b"\n\n") + 2
        events += pending[:end].count(b'"sent_ns":')
        pending = pending[end:]
    writer.close()
    return events, before, stalled


def test_a_stalled_client_holds_the_server_back_and_then_gets_every_event(
    source: SseSource, server_logs: Path
) -> None:
    proxy = Mitmdump(source.url, [], log_dir=server_logs)
    with running(proxy):
        start = time.monotonic()
        events, before, stalled = asyncio.run(read_after_a_stall(proxy.port, proxy.pid))
        took = time.monotonic() - start
    assert events == EVENTS + 1  # and the finish chunk
    # Were the server's writes taken in while the client read nothing, the proxy would
    # hold most of the answer; it holds what the sockets' and transports' buffers take.
    assert stalled - before < 16, (before, stalled, took)
