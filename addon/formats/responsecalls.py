"""A Responses stream's function calls go out whole, as chat tool calls do
(formats/toolcalls.py): a client never holds half a call.

A call is an item of its own: `output_item.added`, its `function_call_arguments.delta`s
and `.done`, then `output_item.done`, each naming the item. Its events are held, by item,
until that `output_item.done`, and then go out together; the other items' events go on
as they come. Servers interleave them: llama-server adds a call's item while its message
item is still open, and adds every call of an answer before it closes any. A call cut by
a handoff was never sent, and the next server writes its own whole.
"""

from __future__ import annotations

from typing import Any

ITEM_EVENTS = ("response.output_item.added", "response.output_item.done")
CALL_EVENTS = ("response.function_call_arguments.delta", "response.function_call_arguments.done")


class CallHold:
    def __init__(self) -> None:
        self._calls: dict[Any, list[bytes]] = {}  # an open call's item id -> its events
        self._last: Any = None  # the call added last, for an event that names no item

    @property
    def open(self) -> bool:
        """Whether a call's events are held."""
        return bool(self._calls)

    def take(self, payload: dict[str, Any], data: bytes) -> list[bytes] | None:
        """None where `payload` is not a function call's event; else it is held (`data`
        as the client gets it), and the call's events are returned once it is whole
        (its `output_item.done`), [] until then."""
        kind = payload.get("type")
        item = payload.get("item") if isinstance(payload.get("item"), dict) else {}
        if kind in ITEM_EVENTS and item.get("type") == "function_call":
            call = item.get("id")
        elif kind in CALL_EVENTS:
            call = payload.get("item_id", self._last)
        else:
            return None
        if kind == "response.output_item.added":
            self._last = call
        self._calls.setdefault(call, []).append(data)
        return self._calls.pop(call) if kind == "response.output_item.done" else []
