"""Whether a server past its wait for a first event is still reading a prompt: its
`/slots` (llama-server's) lists a slot processing with nothing decoded yet. A server that
does not answer that at once (stopped, wedged) or lists no such slot is not."""

from __future__ import annotations

import httpx

from addon.servers.slots import reading_prompt

SLOTS_TIMEOUT_S = 2.0


async def still_reading(url: str, headers: dict[str, str]) -> str | None:
    """What the server is reading, in words; None when it is not (or will not say)."""
    try:
        async with httpx.AsyncClient(timeout=SLOTS_TIMEOUT_S) as client:
            response = await client.get(f"{url}/slots", headers=headers)
            slots = response.raise_for_status().json()
    except (httpx.HTTPError, ValueError):
        return None
    return reading_prompt(slots)
