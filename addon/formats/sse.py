"""Server-sent-event framing for OpenAI-style streams.

The first leg's events are forwarded untouched, so its hot path reads whole blocks
of bytes in one typed decode (formats/blocks.py); JSON is parsed whole for the rare
events that need it (errors, finish, anything unusual) and for the legs whose chunks
are rewritten.
"""

from __future__ import annotations

import json
from typing import Any

from addon.formats.shape import loads

DONE = b"data: [DONE]"
TERMINATOR = b"\n\n"


MAX_EVENT_BYTES = 16 * 1024 * 1024  # no token chunk comes near; over it the stream is garbled


class EventTooLarge(ValueError):
    pass


class EventSplitter:
    """Cuts a byte stream at SSE event boundaries, in time linear in the bytes: an
    unfinished event is kept as a list of pieces and only new bytes are searched."""

    def __init__(self, limit: int = MAX_EVENT_BYTES) -> None:
        self._pending: list[bytes] = []
        self._size = 0
        self._limit = limit
        self._after_cr = False  # the last piece ended in CR: an LF next completes CRLF

    def feed(self, data: bytes) -> bytes:
        """Every complete event received so far, as one block (each event ends in a blank
        line); the incomplete rest is kept for the next call. Raises EventTooLarge when
        an unfinished event grows past the limit."""
        if self._size > self._limit:
            self._pending.append(data)
            raise EventTooLarge(f"an event over {self._limit} bytes")
        if self._after_cr and data.startswith(b"\n"):
            data = data[1:]
        # (find, not `in`: a bytes' `in` first tries its operand as an int, and pays
        # for the TypeError; on every read of every answer that is a third of the check)
        if data.find(b"\r") >= 0:
            self._after_cr = data.endswith(b"\r")
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        else:
            self._after_cr = False
        end = data.rfind(TERMINATOR)
        if end >= 0:
            cut = end + 2
        elif self._pending and data.startswith(b"\n") and self._pending[-1].endswith(b"\n"):
            cut = 1  # the blank line straddles two reads
        else:
            if data:
                self._pending.append(data)
                self._size += len(data)
                if self._size > self._limit:
                    raise EventTooLarge(f"an event over {self._limit} bytes")
            return b""
        block = b"".join([*self._pending, data[:cut]]) if self._pending else data[:cut]
        rest = data[cut:]
        self._pending = [rest] if rest else []
        self._size = len(rest)
        return block  # a rest over the limit is found by the next call, which keeps its data

    def rest(self) -> bytes:
        return b"".join(self._pending)


def events(block: bytes) -> list[bytes]:
    """The events of a block, without their terminators."""
    return [event for event in block.split(TERMINATOR) if event.strip(b"\n")]


def is_comment(event: bytes) -> bool:
    return all(line.startswith(b":") for line in event.split(b"\n"))


def data_of(event: bytes) -> bytes | None:
    """The event's data payload (data lines joined), or None for comment-only events."""
    lines = [line for line in event.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(line[6:] if line[5:6] == b" " else line[5:] for line in lines)


def parse(event: bytes) -> Any:
    """The event's JSON payload; None for comments and [DONE]; raises ValueError if garbled."""
    payload = data_of(event)
    if payload is None or payload.strip() == b"[DONE]":
        return None
    return loads(payload)


def as_array(block: bytes) -> bytes:
    """A block of one-line `data: ` events as one JSON array of their payloads (an event's
    JSON holds no raw newline, so "\n\ndata: " only ever parts two events); a block that is
    not such lines gives no valid JSON, or ValueError at once."""
    if not block.startswith(b"data: ") or not block.endswith(b"\n\n"):
        raise ValueError("not data lines")
    payloads = block[6:-2].replace(b"\n\ndata: ", b",")
    if payloads.find(b"\n") >= 0:  # a line of another field, which parsing would not read
        raise ValueError("not data lines")
    return b"[" + payloads + b"]"


def named_as_array(block: bytes, name: bytes) -> bytes:
    """`as_array` for events that name their type, `name`, on an `event:` line before
    their `data: ` line (Anthropic Messages', OpenAI Responses'; parsing reads the data
    alone); an event named otherwise gives ValueError."""
    return as_array(block.replace(b"event: " + name + b"\ndata: ", b"data: "))


def is_done(event: bytes) -> bool:
    return event == DONE or (data_of(event) or b"").strip() == b"[DONE]"


def encode(payload: Any) -> bytes:
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    try:
        return b"data: " + text.encode()
    except UnicodeEncodeError:  # half of a UTF-16 pair, as its server escaped it: escaped
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode()


def comment(text: str) -> bytes:
    return b"\n".join(b": " + line.encode() for line in text.splitlines()) or b":"
