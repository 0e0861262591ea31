"""Streamed tool calls go out whole: a client never holds half a call.

OpenAI-style streams send a tool call in pieces (its id and name, then its arguments a
fragment at a time). If the server died after some pieces, the client would be left
with a call it cannot parse. So the pieces are held until the call is complete (a later
call starts, or the answer ends) and then sent as one delta. A call cut by a handoff was
never sent, and the next server writes its own whole.
"""

from __future__ import annotations

import copy
from typing import Any


class ToolCallHold:
    def __init__(self) -> None:
        self._calls: dict[int, dict[str, Any]] = {}

    def split(self, chunk: dict[str, Any]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """Take the tool-call pieces out of `chunk`. Returns what is left of the chunk
        (None if nothing) and the calls that are now complete."""
        ready: list[dict[str, Any]] = []
        touched = False
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            for piece in delta.pop("tool_calls", None) or ():
                touched = True
                index = piece.get("index", 0)
                ready += [self._calls.pop(i) for i in sorted(self._calls) if i < index]
                self._merge(index, piece)
        if not touched:
            return chunk, ready
        keep = any(
            (c.get("delta") or {}) or c.get("finish_reason") is not None
            for c in chunk.get("choices") or ()
        )
        return (chunk if keep or chunk.get("usage") else None), ready

    def flush(self) -> list[dict[str, Any]]:
        """Every held call: the answer has ended, so they are complete."""
        calls = [self._calls[i] for i in sorted(self._calls)]
        self._calls.clear()
        return calls

    def _merge(self, index: int, piece: dict[str, Any]) -> None:
        call = self._calls.setdefault(index, {"index": index, "function": {"arguments": ""}})
        for key in ("id", "type"):
            if piece.get(key):
                call[key] = piece[key]
        function = piece.get("function") or {}
        if function.get("name"):
            call["function"]["name"] = function["name"]
        call["function"]["arguments"] += function.get("arguments") or ""


def calls_chunk(envelope: dict[str, Any], calls: list[dict[str, Any]]) -> dict[str, Any]:
    """A chunk carrying whole calls, in the stream's own envelope (id, created, model)."""
    chunk = {k: copy.deepcopy(v) for k, v in envelope.items() if k not in ("choices", "usage")}
    chunk["choices"] = [{"index": 0, "delta": {"tool_calls": calls}, "finish_reason": None}]
    return chunk
