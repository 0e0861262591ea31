"""Ask a server once whether it echoes an assistant prefill back at the start of its answer.

Some llama-server builds send the prefill again as part of the first content delta,
others send only the continuation. Knowing which keeps the splice from dropping real
text that merely looks like the prefill.
"""

from __future__ import annotations

import json
import logging

from addon import sse
from addon.upstream import Upstream, UpstreamError, post

log = logging.getLogger(__name__)
MARKER = "Zq7 "


async def echoes_prefill(upstream: Upstream, path: str = "/v1/chat/completions") -> bool | None:
    """True or False, or None when the server could not be asked."""
    body = {
        "messages": [
            {"role": "user", "content": "Continue."},
            {"role": "assistant", "content": MARKER},
        ],
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
    }
    try:
        response = await post(upstream, path, json.dumps(body).encode(), [])
        try:
            if response.status != 200:
                return None
            raw = await response.read_all()
        finally:
            response.close()
    except UpstreamError as exc:
        log.info("cannot probe %s for prefill echo: %s", upstream.url, exc)
        return None
    text = ""
    for event in sse.events(raw):
        try:
            chunk = sse.parse(event)
        except ValueError:
            return None
        for choice in (chunk or {}).get("choices") or ():
            text += (choice.get("delta") or {}).get("content") or ""
    return text.startswith(MARKER)
