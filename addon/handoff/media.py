"""Media in a chat request (an image, audio, a video: any content part that is not
text), which only a chat route carries to the next server.

An engine's rendering of such a request stands for each picture with a placeholder:
llama-server's `/apply-template` writes a marker (`<__media_…__>`) that its native
`/completion`, like any text route, reads as plain text; vLLM's ids hold placeholder
tokens that a prompt of ids does not fill. A text or token-id continuation would have
the next server go on describing a picture it cannot see, so such a request goes on
only by a chat route that carries the original messages, pictures included, and is
checked as any other (handoff/builder.py); else it ends in-band, saying why.
"""

from __future__ import annotations

import re
from typing import Any

# llama-server's marker: mtmd's `<__media__>`, or its server's `<__media_` + 32 random
# letters and digits + `__>` (one per process).
MARKER = re.compile(r"<__media(?:_[0-9A-Za-z]*)?__>")
KINDS = {
    "image_url": "an image", "input_image": "an image", "input_audio": "audio",
    "input_video": "a video", "video_url": "a video", "file": "a file",
}  # fmt: skip
NOT_BY_TEXT = "a text or token continuation would not show it to the next server"


def held(chat: dict[str, Any], rendered: str | None = None) -> str | None:
    """What media the chat request's messages hold ("an image", ...), or its rendering
    `rendered` stands for (llama-server's marker in it); None where there is none."""
    for message in chat.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                return KINDS.get(str(kind), f"a content part of type {kind!r}")
    if rendered is not None and MARKER.search(rendered):
        return "media (llama-server's media marker is in its rendering)"
    return None


def refusal(what: str) -> str:
    """Why no text or token-id leg continues a request that holds `what`."""
    return f"the request holds {what}: {NOT_BY_TEXT}"
