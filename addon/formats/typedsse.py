"""The shared half of the APIs whose SSE events name their type (Anthropic Messages,
OpenAI Responses): framing, parsing, the in-band error check and the rewriting of a
continuation leg's events, before each API sorts them for the pump (`sort`) and records
them (`record`)."""

from __future__ import annotations

from typing import Any

from addon.formats import sse
from addon.formats.dialect import Event, Garbled, Rewriter, Step, json_object
from addon.formats.transcript import Transcript

SEP = sse.TERMINATOR


def encode(payload: dict[str, Any]) -> bytes:
    """An event as these APIs frame it: its type named on an `event:` line too."""
    return b"event: " + str(payload.get("type")).encode() + b"\n" + sse.encode(payload) + SEP


class TypedEventReader:
    boundary = SEP
    splitter = sse.EventSplitter
    events = staticmethod(sse.events)

    def __init__(self, transcript: Transcript, rewriter: Rewriter | None, server: str) -> None:
        self.transcript = transcript
        self.rewriter = rewriter
        self.server = server

    def failure(self, payload: dict[str, Any]) -> str | None:
        """What went wrong, when the event reports an error."""
        raise NotImplementedError

    def sort(self, payload: dict[str, Any], data: bytes) -> list[Event]:
        raise NotImplementedError

    def record(self, payload: dict[str, Any]) -> None:
        raise NotImplementedError

    def take(self, event: bytes) -> list[Event] | str:
        if sse.is_comment(event):
            return [Event(Step.SEND, event + SEP)]
        payload = json_object(event, sse.parse)
        if isinstance(payload, str):
            return Garbled(f"garbled event from {self.server}: {payload}")
        if (failure := self.failure(payload)) is not None:
            return f"in-band error from {self.server}: {failure}"
        if self.rewriter is None:
            return self.sort(payload, event + SEP)
        return [e for new in self.rewriter.rewrite(payload) for e in self.sort(new, encode(new))]
