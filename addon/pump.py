"""One leg's events into the client's stream.

Ordinary token blocks of a first leg go out unread (a few byte scans per read: the hot
path). Anything else is parsed: a continuation leg's chunks are rewritten into the
client's stream, ids the client did not ask for are taken out, tool-call pieces are held
until a call is whole, and the finishing chunks are held until [DONE] so that nothing
after the answer's end is lost or doubled if the leg dies there.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from addon import sse
from addon.continuation import Transcript, take_pieces
from addon.exact import Rewriter
from addon.pace import Pace
from addon.toolcalls import ToolCallHold, calls_chunk
from addon.wire import ClientStream, error_text

SEP = sse.TERMINATOR


def ends_answer(chunk: dict[str, Any]) -> bool:
    choices = chunk.get("choices")
    if not choices:
        return bool(chunk.get("usage"))
    return any(choice.get("finish_reason") is not None for choice in choices)


class Pump:
    def __init__(
        self,
        client: ClientStream,
        transcript: Transcript,
        rewriter: Rewriter | None,
        strip_pieces: bool,
        pace: Pace | None,
        flush: Callable[[list[bytes]], None],
        finishing: Callable[[], None],
    ) -> None:
        """`flush(events)` writes parsed events to the client; `finishing()` says the
        answer's end has been seen (no handoff may cut it any more)."""
        self.client = client
        self.transcript = transcript
        self.rewriter = rewriter
        self.strip_pieces = strip_pieces
        self.pace = pace
        self.flush = flush
        self.finishing = finishing
        self.closed = False  # the server closed the stream mid-answer
        self._calls = ToolCallHold()  # a new leg starts with no call pieces: cut ones dropped
        self._held: list[bytes] = []  # the finishing chunks, until [DONE]

    async def run(self, body: AsyncIterator[bytes], server: str) -> str | None:
        """None when the answer is complete, otherwise why the leg failed."""
        splitter = sse.EventSplitter()
        client, transcript, pace = self.client, self.transcript, self.pace
        # Chunks carrying ids the client did not ask for are read, to take the ids out.
        fast = self.rewriter is None and not self.strip_pieces
        async for data in body:
            if pace is not None:
                pace.saw(time.monotonic(), data.count(SEP))
            try:
                block = splitter.feed(data)
            except sse.EventTooLarge as exc:
                return f"garbled stream from {server}: {exc}"
            if not block:
                continue
            if fast and not self._held and sse.only_plain_chunks(block):
                client.write(block)  # the hot path: ordinary tokens, forwarded unread
                transcript.record_raw(block)
                await client.drain()
                continue
            transcript.settle()
            out: list[bytes] = []
            for event in sse.events(block):
                failure = self._event(event, out, server)
                if failure is not None:
                    if failure:
                        self.flush(out)
                        return failure
                    return None  # [DONE]: the answer went out whole
            if out:
                self.flush(out)
                await client.drain()
        if self._held:
            # The server finished its answer and died before [DONE]: the answer is whole.
            client.end(b"".join(self._held) + sse.DONE + SEP)
            return None
        self.closed = True
        return f"{server} closed the stream mid-answer"

    def _event(self, event: bytes, out: list[bytes], server: str) -> str | None:
        """Take one event into `out`: None to go on, "" when the answer ended with [DONE]
        (sent), else why the leg failed."""
        if sse.is_comment(event):
            out.append(event + SEP)
            return None
        if sse.is_done(event):
            self.client.end(b"".join(out) + b"".join(self._held) + sse.DONE + SEP)
            return ""
        try:
            chunk = sse.parse(event)
            if not isinstance(chunk, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            return f"garbled event from {server}: {exc}"
        if "error" in chunk:
            return f"in-band error from {server}: {error_text(chunk['error'])}"
        changed = self.rewriter is not None
        if self.rewriter is not None:
            chunk = self.rewriter.rewrite(chunk)
            if chunk is None:
                return None
        pieces = None
        if self.strip_pieces and (changed or b'"logprobs"' in event):
            pieces = take_pieces(chunk, strip=True)
            changed = True
        if changed:
            event = sse.encode(chunk)
        if b'"tool_calls"' in event:
            envelope = {k: v for k, v in chunk.items() if k != "choices"}
            chunk, ready = self._calls.split(chunk)
            if ready:
                whole = calls_chunk(envelope, ready)
                out.append(sse.encode(whole) + SEP)
                self.transcript.record(whole)
            if chunk is None:
                return None
            event = sse.encode(chunk)
        if self._held or ends_answer(chunk):
            self.transcript.timed(chunk)
            self.finishing()
            if ready := self._calls.flush():
                self._held.append(sse.encode(calls_chunk(chunk, ready)) + SEP)
            self._held.append(event + SEP)
            return None
        out.append(event + SEP)
        self.transcript.record(chunk, pieces)
        return None
