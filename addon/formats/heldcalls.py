"""Tool calls in the APIs whose events name their type go out whole, as chat tool calls
do (formats/toolcalls.py): a client never holds half a call.

A call is an item of its own (a Responses `function_call` item, a Messages `tool_use`
block): an event opens it, events carry its arguments, an event closes it, each naming
it (its item id, its block index). Its events are held, by that name, until it closes,
and then go out together; other events go on as they come. Servers interleave them:
llama-server opens a call while its message item or text block is still open, and opens
every call of an answer before it closes any. A call cut by a handoff was never sent,
and the next server writes its own whole.
"""

from __future__ import annotations

from typing import Any

TOOL_BLOCKS = ("tool_use", "server_tool_use")
RESPONSES_ITEM = ("response.output_item.added", "response.output_item.done")
RESPONSES_ARGUMENTS = (
    "response.function_call_arguments.delta", "response.function_call_arguments.done",
)  # fmt: skip

Part = tuple[Any, bool, bool]  # the call an event belongs to: its name, opens, closes


def responses_part(payload: dict[str, Any]) -> Part | None:
    """The function call a Responses event belongs to (None: none)."""
    kind = payload.get("type")
    item = payload.get("item") if isinstance(payload.get("item"), dict) else {}
    if kind in RESPONSES_ITEM and item.get("type") == "function_call":
        return item.get("id"), kind == RESPONSES_ITEM[0], kind == RESPONSES_ITEM[1]
    if kind in RESPONSES_ARGUMENTS:
        return payload.get("item_id"), False, False
    return None


def messages_part(payload: dict[str, Any]) -> Part | None:
    """The tool_use block a Messages event belongs to (None: none, or another block)."""
    kind, index = payload.get("type"), payload.get("index")
    block = payload.get("content_block") or {}
    if kind == "content_block_start":
        return (index, True, False) if block.get("type") in TOOL_BLOCKS else None
    if kind in ("content_block_delta", "content_block_stop"):
        return index, False, kind == "content_block_stop"
    return None


class HeldCalls:
    def __init__(self) -> None:
        self._calls: dict[Any, list[bytes]] = {}  # an open call's name -> its events

    @property
    def open(self) -> bool:
        """Whether a call's events are held."""
        return bool(self._calls)

    def take(self, part: Part | None, data: bytes) -> list[bytes] | None:
        """None where `data` (an event as the client gets it, of the call `part`) is no
        held call's; else it is held, and the call's events are returned once it closes,
        [] until then."""
        if part is None:
            return None
        name, opens, closes = part
        if not opens and name not in self._calls:
            return None  # another item's event
        self._calls.setdefault(name, []).append(data)
        return self._calls.pop(name) if closes else []
