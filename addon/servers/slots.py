"""A llama-server's slots, as its `/slots` lists them."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any


def idle_slots(slots: Any, taken: Collection[int] = ()) -> list[dict[str, Any]]:
    """The slots that are idle (it says so) and not in `taken`, in the server's order; an
    answer that is not a list of slots has none."""
    if not isinstance(slots, list):
        return []
    return [
        s for s in slots
        if isinstance(s, dict) and s.get("is_processing") is False and s.get("id") not in taken
    ]  # fmt: skip


def unused_first(slots: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Slots that never ran a task (nothing of another client's in them) before the rest."""
    return sorted(slots, key=lambda s: "id_task" in s)
