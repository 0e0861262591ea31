"""Whether a server past its wait for a first event is still at work: its `/slots`
(llama-server's) lists a slot processing, reading a prompt (perhaps this one) or writing
an answer while this one waits for a slot. A server that does not answer that at once
(stopped, wedged: the list is made by the loop that computes) or lists no slot at work
is not."""

from __future__ import annotations

import httpx

from addon.servers.slots import working

SLOTS_TIMEOUT_S = 2.0


async def still_reading(url: str, headers: dict[str, str]) -> str | None:
    """What the server is doing, in words; None when nothing (or it will not say)."""
    try:
        async with httpx.AsyncClient(timeout=SLOTS_TIMEOUT_S) as client:
            response = await client.get(f"{url}/slots", headers=headers)
            slots = response.raise_for_status().json()
    except (httpx.HTTPError, ValueError):
        return None
    return working(slots)
