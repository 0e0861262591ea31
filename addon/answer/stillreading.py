"""Whether a server past its wait for a first event is still at work.

llama-server's `/slots` lists a slot processing: reading a prompt (perhaps this one) or
writing an answer while this one waits for a slot. A server without it (vLLM) is asked
its `/metrics` twice, a second apart: tokens read or written meanwhile, for any request,
mean its queue moves and this answer waits its turn (a busy server, whose first tokens
come later than any it gave before). A server that answers neither at once (stopped,
wedged: llama-server's lists are made by the loop that computes), or whose lists show no
work, is not at work.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from addon.servers.progress import Progress, progress_of
from addon.servers.slots import working
from addon.servers.tls import tls_context

SLOTS_TIMEOUT_S = 2.0
COUNTED_AGAIN_S = 1.0  # between the two readings of /metrics


async def still_reading(url: str, headers: dict[str, str]) -> str | None:
    """What the server is doing, in words; None when nothing (or it will not say)."""
    try:
        async with httpx.AsyncClient(timeout=SLOTS_TIMEOUT_S, verify=tls_context()) as client:
            response = await client.get(f"{url}/slots", headers=headers)
            if response.status_code != 404:  # (404: it keeps no slots, as vLLM)
                return working(response.raise_for_status().json())
            return await _counting(client, url, headers)
    except (httpx.HTTPError, ValueError):
        return None


async def _counting(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> str | None:
    """The tokens the server counts, twice: what it did between the two, if anything."""
    if (first := await _progress(client, url, headers)) is None:
        return None
    asked = time.monotonic()
    await asyncio.sleep(COUNTED_AGAIN_S)
    then = await _progress(client, url, headers)
    return None if then is None else then.since(first, round(time.monotonic() - asked, 1))


async def _progress(
    client: httpx.AsyncClient, url: str, headers: dict[str, str]
) -> Progress | None:
    response = await client.get(f"{url}/metrics", headers=headers)
    return progress_of(response.raise_for_status().text)
