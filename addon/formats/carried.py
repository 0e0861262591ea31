"""Which requests the addon carries across servers, and which responses it lets through
as they arrive."""

from __future__ import annotations

from typing import Any

from mitmproxy import http

from addon.formats.chat import Chat
from addon.formats.dialect import Dialect
from addon.formats.messages import Messages
from addon.formats.ollama import Ollama, OllamaGenerate
from addon.formats.responses import Responses
from addon.formats.shape import loads, nested_deeper_than

CHAT, TEXT = Chat("messages"), Chat("prompt")
# Spliced routes, each with its wire format.
SPLICED: dict[str, Dialect] = {
    "/v1/chat/completions": CHAT,
    "/chat/completions": CHAT,
    "/v1/completions": TEXT,
    "/completions": TEXT,
    "/v1/messages": Messages(),
    "/v1/responses": Responses(),
    "/api/chat": Ollama(),
    "/api/generate": OllamaGenerate(),
}


def spliceable(request: http.Request) -> tuple[dict[str, Any], Dialect] | None:
    """The parsed body of a request this addon can carry, and its wire format; else None."""
    dialect = SPLICED.get(request.path.split("?")[0])
    if request.method != "POST" or dialect is None:
        return None
    try:
        body = loads(request.content or b"")  # (an undecodable body: a ValueError too)
    except ValueError:
        return None  # the server answers malformed JSON with its own clear 400
    if not isinstance(body, dict) or nested_deeper_than(body) or not dialect.accepts(body):
        return None  # malformed, or a shape not carried: passed through as it is
    return body, dialect


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
