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


def working(slots: Any) -> str | None:
    """What the server says it is doing, in words, when a slot is processing (reading a
    prompt, or writing an answer while others wait for a slot); None when none is."""
    if not isinstance(slots, list):
        return None
    busy = [s for s in slots if isinstance(s, dict) and s.get("is_processing") is True]
    for slot in busy:
        progress = slot.get("next_token")
        decoded = progress[0].get("n_decoded") if isinstance(progress, list) and progress else None
        if decoded == 0:
            return f"slot {slot.get('id')} reading {slot.get('n_prompt_tokens', '?')} prompt tokens"
    return f"{len(busy)} of {len(slots)} slots writing answers" if busy else None
