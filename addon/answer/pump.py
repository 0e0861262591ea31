"""One leg's events into the client's stream, whatever its wire format.

Blocks its reader calls plain go out unread (one typed decode per read: the hot path).
Anything else is taken event by event: the reader parses it, rewrites it for the client's
stream and says whether it goes out now, waits for what follows, or belongs to the
answer's end, which is held back whole until the stream's last event so that nothing
after the answer's end is lost or doubled if the leg dies there.

All of that is one synchronous step per read (`feed`), so a leg's reads are pumped in the
event loop's callback that received them (`run_pushed`: no task woken, no await per
token); a leg whose body is adapted by a coroutine first is pumped in turn (`run`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from addon.answer.pace import Pace
from addon.formats.dialect import Event, Garbled, LegReader, Step
from addon.formats.sse import EventTooLarge
from addon.formats.transcript import Transcript
from addon.formats.wire import ClientStream
from addon.servers.upstream import Response, UpstreamError

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
        ending: Callable[[], None] = lambda: None,
    ) -> None:
        """`flush(events)` writes taken events to the client; `finishing()` says the
        answer's end has been seen (no handoff may cut it any more); `may_move()`, whether
        another server could go on with the answer now (else a garbled event goes to the
        client as the server sent it, and the leg goes on); `ending()`, that the answer's
        last bytes go out next (what is kept of the leg is complete before the client's
        flow is)."""
        self.client = client
        self.transcript = transcript
        self.reader = reader
        self.pace = pace
        self.flush = flush
        self.finishing = finishing
        self.may_move = may_move
        self.ending = ending
        self.closed = False  # the server closed the stream mid-answer
        self.outcome: str | None = None  # once `feed` said the leg is over: why, or None
        self.server = ""
        self._held: list[Event] = []
        self._splitter = reader.splitter()
        self._passing = False  # the rest goes out as sent (see `_pass_on`)
        self._stop: Callable[[], None] | None = None  # a pushed leg's end, now

    async def run(self, body: AsyncIterator[bytes], server: str) -> str | None:
        """Pump `body` in turn. None when the answer is complete, otherwise why the leg
        failed."""
        self.server = server
        async for data in body:
            if self.feed(data):
                return self.outcome
            await self.client.drain()
        return self.finish()

    async def run_pushed(self, response: Response, server: str) -> str | None:
        """Pump `response`'s body in the callbacks that receive it; as `run`. While the
        client's connection is backed up, the server's is not read."""
        self.server = server
        done: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        draining: list[asyncio.Task[None]] = []

        def settle(step: Callable[[], str | None]) -> None:
            # `done` is cancelled the moment the leg is (a handoff decided in `step`'s
            # own work too): nothing more goes out, nothing is settled twice.
            try:
                outcome = step()
            except Exception as exc:
                if not done.done():
                    done.set_exception(exc)
                return
            if not done.done():
                done.set_result(outcome)

        def on_body(data: bytes) -> None:
            if done.done():
                return
            try:
                over = self.feed(data)
            except Exception as exc:
                if not done.done():
                    done.set_exception(exc)
                return
            if over:
                settle(lambda: self.outcome)
            elif self.client.backed_up() and not draining:
                response.pause()
                draining.append(asyncio.ensure_future(self._resume_drained(response, draining)))

        def on_end(error: UpstreamError | None) -> None:
            if done.done():
                return
            if error is not None:
                done.set_exception(error)
            else:
                settle(self.finish)

        def stop() -> None:
            response.close()
            settle(self.finish)

        self._stop = stop
        response.push(on_body, on_end)
        try:
            return await done
        finally:
            self._stop = None
            for task in draining:
                task.cancel()

    def end_now(self) -> bool:
        """End the leg as if its server closed the stream now (it sent the answer's end and
        then nothing more); False where this leg is not pushed (an adapted one), or over."""
        if self._stop is None:
            return False
        self._stop()
        return True

    async def _resume_drained(self, response: Response, draining: list[asyncio.Task[None]]) -> None:
        try:
            await self.client.drain()
        except ConnectionError:
            return  # the client left: the endpoint cancels the answer
        finally:
            draining.clear()
        response.resume()

    def feed(self, data: bytes) -> bool:
        """Take one read of the leg's body; True when the leg is over (`outcome` says how)."""
        if self._passing:
            self.client.write(data)
            return False
        reader, pace = self.reader, self.pace
        if pace is not None:
            pace.saw(time.monotonic(), data.count(reader.boundary))
        try:
            block = self._splitter.feed(data)
        except EventTooLarge as exc:
            why = f"garbled stream from {self.server}: {exc}"
            if self.may_move():
                return self._over(why)
            self._pass_on(why)
            return False
        if not block:
            return False
        if not self._held and (unread := reader.plain(block)) is not None:
            self.client.write(unread)  # the hot path: ordinary tokens, forwarded unread
            return False
        out: list[bytes] = []
        for event in reader.events(block):
            taken = reader.take(event)
            if isinstance(taken, Garbled) and not self.may_move():
                log.info("%s; passed on as sent: no other server could go on", taken)
                self.transcript.other_parts.add(UNREAD)
                out.append(event + reader.boundary)
                continue
            if isinstance(taken, str):
                self.flush(out)
                return self._over(taken)
            if self._put(taken, out):
                return self._over(None)  # the answer went out whole
        self.flush(out)
        return False

    def finish(self) -> str | None:
        """The body ended: None when the answer is complete, otherwise why the leg failed."""
        if self._passing:
            self.ending()
            self.client.end(b"")
            return None
        if (last := self.reader.close()) is not None:
            # The server finished its answer and died before its last event: it is whole.
            self._end([e.data for e in self._held], last)
            return None
        self.closed = True
        return f"{self.server} closed the stream mid-answer"

    def _over(self, outcome: str | None) -> bool:
        self.outcome = outcome
        return True

    def _pass_on(self, why: str) -> None:
        """From now on the leg goes out as its server sends it, unread (an event too large
        to read, with no other server to go to): the answer ends when the server ends it."""
        log.info("%s; passed on as sent: no other server could go on", why)
        self.transcript.other_parts.add(UNREAD)
        self.finishing()
        self.flush([*(e.data for e in self._held), self._splitter.rest()])
        self._held = []
        self._passing = True

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
        self.ending()
        self.client.end(last)

    def _record(self, event: Event) -> None:
        if event.payload is not None:
            self.reader.record(event.payload)
