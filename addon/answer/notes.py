"""What a spliced answer tells its client of where it went: why it started where it did
and each handoff, in a comment line each in the stream's own form (held until the stream
has begun), or in response headers for an answer that is not streamed. Nothing is said
of an answer that stayed on its primary."""

from __future__ import annotations

from collections.abc import Sequence

from addon.formats.dialect import Dialect
from addon.formats.wire import ClientStream, Header
from addon.handoff.record import Handoff


class Notes:
    def __init__(self, dialect: Dialect, route_note: str | None) -> None:
        self._dialect = dialect
        self._route_note = route_note
        self._told = 0  # handoffs told
        self._held: list[bytes] = []
        if route_note and (note := dialect.note(f"spillover: {route_note}")):
            self._held.append(note)

    def tell(self, client: ClientStream, handoffs: Sequence[Handoff]) -> None:
        """Every handoff not told yet (a leg dropped before it began left its own untold)."""
        lines = self._dialect.note
        notes = [n for h in handoffs[self._told :] if (n := lines(f"spillover: {h.describe()}"))]
        self._told = len(handoffs)
        if client.started:
            client.write(b"".join(notes))
        else:
            self._held.extend(notes)

    def release(self, client: ClientStream) -> None:
        """The stream has begun: what was held goes out first."""
        if self._held:
            client.write(b"".join(self._held))
            self._held.clear()

    def headers(self, handoffs: Sequence[Handoff]) -> list[Header]:
        """The notes of an answer that is not streamed."""
        notes = [(b"x-spillover-handoff", h.describe().encode()) for h in handoffs]
        if self._route_note:
            notes.insert(0, (b"x-spillover-route", self._route_note.encode()))
        return notes
