"""Which requests the addon carries across servers, and which responses it lets through
as they arrive."""

from __future__ import annotations

import json
from typing import Any

from mitmproxy import http

# Spliced routes, and the field that holds what the answer continues from.
SPLICED = {
    "/v1/chat/completions": "messages",
    "/chat/completions": "messages",
    "/v1/completions": "prompt",
    "/completions": "prompt",
}


def spliceable_body(request: http.Request) -> dict[str, Any] | None:
    """The parsed body of a chat or text completion this addon can carry, else None."""
    field = SPLICED.get(request.path.split("?")[0])
    if request.method != "POST" or field is None:
        return None
    try:
        body = json.loads(request.content or b"")
    except ValueError:
        return None  # the primary answers malformed JSON with its own clear 400
    if not isinstance(body, dict):
        return None
    if not isinstance(body.get(field), list if field == "messages" else str):
        return None  # malformed, or token-id prompts: passed through as they are
    if field == "messages" and not all(isinstance(m, dict) for m in body["messages"]):
        return None  # malformed: the primary answers with its own error
    if body.get("n", 1) != 1:
        return None  # several choices per answer are not spliced: passed through as they are
    return body


def arrives_in_pieces(response: http.Response) -> bool:
    """An event stream, NDJSON or any chunked body: the client reads it as it comes
    (llama-server's native /completion stream, Ollama-style NDJSON), so mitmproxy must
    not hold it back until the end."""
    kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
    chunked = "chunked" in response.headers.get("transfer-encoding", "").lower()
    return chunked or kind in ("text/event-stream", "application/x-ndjson")


def recorded(flow: http.HTTPFlow) -> bool:
    """A flow this addon made or carried before, read back from a recording."""
    return "spillover" in flow.metadata or "spillover_exchange" in flow.metadata
