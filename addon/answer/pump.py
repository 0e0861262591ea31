"""One leg's events into the client's stream, whatever its wire format.

Blocks its reader calls plain go out unread (a few byte scans per read: the hot path).
Anything else is taken event by event: the reader parses it, rewrites it for the client's
stream and says whether it goes out now, waits for what follows, or belongs to the
answer's end, which is held back whole until the stream's last event so that nothing
after the answer's end is lost or doubled if the leg dies there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable

from addon.answer.pace import Pace
from addon.formats.dialect import Event, Garbled, LegReader, Splitter, Step
from addon.formats.sse import EventTooLarge
from addon.formats.transcript import Transcript
from addon.formats.wire import ClientStream

log = logging.getLogger(__name__)
# What a transcript cannot replay once an event went out unread (see Transcript.other_parts).
UNREAD = "an event that could not be read"


class Pump:
    def __init__(
        self,
        client: ClientStream,
        transcript: Transcript,
        reader: LegReader,
        pace: Pace | None,
        flush: Callable[[list[bytes]], None],
        finishing: Callable[[], None],
        may_move: Callable[[], bool] = lambda: True,
    ) -> None:
        """`flush(events)` writes taken events to the client; `finishing()` says the
        answer's end has been seen (no handoff may cut it any more); `may_move()`, whether
        another server could go on with the answer now (else a garbled event goes to the
        client as the server sent it, and the leg goes on)."""
        self.client = client
        self.transcript = transcript
        self.reader = reader
        self.pace = pace
        self.flush = flush
        self.finishing = finishing
        self.may_move = may_move
        self.closed = False  # the server closed the stream mid-answer
        self._held: list[Event] = []

    async def run(self, body: AsyncIterator[bytes], server: str) -> str | None:
        """None when the answer is complete, otherwise why the leg failed."""
        reader, client, transcript, pace = self.reader, self.client, self.transcript, self.pace
        splitter = reader.splitter()
        async for data in body:
            if pace is not None:
                pace.saw(time.monotonic(), data.count(reader.boundary))
            try:
                block = splitter.feed(data)
            except EventTooLarge as exc:
                if self.may_move():
                    return f"garbled stream from {server}: {exc}"
                return await self._pass_on(f"garbled stream from {server}: {exc}", splitter, body)
            if not block:
                continue
            if not self._held and (unread := reader.plain(block)) is not None:
                client.write(unread)  # the hot path: ordinary tokens, forwarded unread
                transcript.record_raw(block, reader.read_block)
                await client.drain()
                continue
            transcript.settle()
            out: list[bytes] = []
            for event in reader.events(block):
                taken = reader.take(event)
                if isinstance(taken, Garbled) and not self.may_move():
                    log.info("%s; passed on as sent: no other server could go on", taken)
                    transcript.other_parts.add(UNREAD)
                    out.append(event + reader.boundary)
                    continue
                if isinstance(taken, str):
                    self.flush(out)
                    return taken
                if self._put(taken, out):
                    return None  # the answer went out whole
            if out:
                self.flush(out)
                await client.drain()
        if (last := reader.close()) is not None:
            # The server finished its answer and died before its last event: it is whole.
            self._end([e.data for e in self._held], last)
            return None
        self.closed = True
        return f"{server} closed the stream mid-answer"

    async def _pass_on(self, why: str, splitter: Splitter, body: AsyncIterator[bytes]) -> None:
        """The rest of the leg as its server sends it, unread (an event too large to read,
        with no other server to go to): the answer ends when the server ends it."""
        log.info("%s; passed on as sent: no other server could go on", why)
        self.transcript.other_parts.add(UNREAD)
        self.finishing()
        self.flush([*(e.data for e in self._held), splitter.rest()])
        self._held = []
        async for data in body:
            self.client.write(data)
            await self.client.drain()
        self.client.end(b"")

    def _put(self, taken: list[Event], out: list[bytes]) -> bool:
        """Send, hold or end with each event; True when the stream has ended."""
        for event in taken:
            if event.step is Step.END:
                self._end([*out, *(e.data for e in self._held)], event.data)
                return True
            if event.step is Step.SEND:
                # What waited for something to follow goes out first; the answer's end
                # stays held (a chat tool call whole after it goes out, as it did).
                for held in self._held:
                    if held.step is Step.HOLD:
                        out.append(held.data)
                        self._record(held)
                self._held = [held for held in self._held if held.step is Step.FINISH]
                out.append(event.data)
                self._record(event)
                continue
            if event.step is Step.FINISH:
                self.finishing()
            self._held.append(event)
        return False

    def _end(self, out: list[bytes], last: bytes) -> None:
        if out:
            self.flush(out)  # through the splice, which times a handoff's pause by it
        self.client.end(last)

    def _record(self, event: Event) -> None:
        if event.payload is not None:
            self.reader.record(event.payload)
