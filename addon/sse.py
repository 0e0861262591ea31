"""Server-sent-event framing for OpenAI-style streams, with cheap byte-level checks.

The primary's events are forwarded untouched, so the hot path looks at bytes only;
JSON is parsed for the rare events that need it (errors, finish) and for the legs
whose chunks are rewritten.
"""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]"
TERMINATOR = b"\n\n"


class EventSplitter:
    """Cuts a byte stream into complete SSE events (without their blank-line terminator)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._buffer + data
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *events, self._buffer = buffer.split(TERMINATOR)
        return [event for event in events if event.strip(b"\n")]

    @property
    def pending(self) -> bytes:
        return self._buffer


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


def may_be_error(event: bytes) -> bool:
    return b'"error"' in event


def may_be_finish(event: bytes) -> bool:
    """True for any event that could end the answer: a finish_reason that is not null,
    or a usage-only chunk. False positives are settled by parsing."""
    if b'"finish_reason"' not in event:
        return b'"usage"' in event
    return b'"finish_reason":null' not in event and b'"finish_reason": null' not in event


def encode(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


def comment(text: str) -> bytes:
    return b"\n".join(b": " + line.encode() for line in text.splitlines()) or b":"
