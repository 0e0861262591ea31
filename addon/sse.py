"""Server-sent-event framing for OpenAI-style streams, with cheap byte-level checks.

The first leg's events are forwarded untouched, so its hot path looks at whole blocks
of bytes; JSON is parsed for the rare events that need it (errors, finish, anything
unusual), for the legs whose chunks are rewritten, and lazily at a handoff.
"""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]"
TERMINATOR = b"\n\n"


class EventSplitter:
    """Cuts a byte stream at SSE event boundaries."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> bytes:
        """Every complete event received so far, as one block (each event ends in a blank
        line); the incomplete rest is kept for the next call."""
        buffer = self._buffer + data if self._buffer else data
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        end = buffer.rfind(TERMINATOR)
        if end < 0:
            self._buffer = buffer
            return b""
        self._buffer = buffer[end + 2 :]
        return buffer[: end + 2]


def events(block: bytes) -> list[bytes]:
    """The events of a block, without their terminators."""
    return [event for event in block.split(TERMINATOR) if event.strip(b"\n")]


def only_plain_chunks(block: bytes) -> bool:
    """True when every event in the block is an ordinary `data: {...}` chunk that neither
    ends the answer, reports an error nor carries a piece of a tool call: such a block can
    be forwarded unread. Anything
    else (or anything that merely looks like it) goes through the event-by-event path."""
    n = block.count(TERMINATOR)
    return (
        block.count(b"data: {") == n
        and block.count(b"}\n\n") == n
        and b'"error"' not in block
        and b"[DONE]" not in block
        and b'"finish_reason":"' not in block
        and b'"finish_reason": "' not in block
        and b'"usage"' not in block
        and b'"tool_calls"' not in block
    )


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
    return json.loads(payload)


def is_done(event: bytes) -> bool:
    return event == DONE or (data_of(event) or b"").strip() == b"[DONE]"


def encode(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


def comment(text: str) -> bytes:
    return b"\n".join(b": " + line.encode() for line in text.splitlines()) or b":"
