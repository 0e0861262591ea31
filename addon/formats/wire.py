"""What goes back to the client: the response it reads, the headers that pass, errors.

`ClientStream` is where a splice writes (the endpoint's connection back to mitmproxy);
errors a splice raises itself are written in llama-server's own format.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from addon.formats import sse

HOP_BY_HOP = {
    b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"te", b"trailer",
    b"upgrade", b"proxy-authenticate", b"proxy-authorization", b"content-encoding",
}  # fmt: skip
# A response reaches the client with every header the server wrote, in its order; the
# endpoint frames the body itself (chunked for a stream), where the server's framing was.
FRAMING = {b"transfer-encoding", b"content-length"}
Header = tuple[bytes, bytes]


class ClientStream(Protocol):
    """Where the spliced response goes (the endpoint's connection back to mitmproxy)."""

    @property
    def started(self) -> bool: ...

    def start(self, status: int, headers: list[Header], reason: bytes = b"") -> None: ...

    def write(self, data: bytes) -> None: ...

    def end(self, last: bytes = b"") -> None: ...

    def respond(
        self, status: int, headers: list[Header], body: bytes, reason: bytes = b""
    ) -> None: ...

    async def drain(self) -> None: ...

    def backed_up(self) -> bool:
        """Whether what was written waits to be sent beyond what `drain` lets pass."""
        ...


def forwardable(headers: Sequence[Header]) -> list[Header]:
    """A client's request headers that go on to a server (hop-by-hop ones do not)."""
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP]


def framed(headers: Sequence[Header], framing: Header) -> list[Header]:
    """`headers` with `framing` (how the endpoint frames the body) in the place of the
    first framing header they have, and no other; at the end when they have none."""
    out: list[Header] = []
    for name, value in headers:
        if name.lower() not in FRAMING:
            out.append((name, value))
        elif framing not in out:
            out.append(framing)
    return out if framing in out else [*out, framing]


def asks_to_close(headers: Sequence[Header]) -> bool:
    """Whether a client's request says `Connection: close` (its leg says so too, so the
    server's answer reads as it would to the client directly)."""
    return any(
        k.lower() == b"connection" and b"close" in [t.strip() for t in v.lower().split(b",")]
        for k, v in headers
    )


def error_event(message: str, code: int = 503) -> bytes:
    """An in-band error in llama-server's own format."""
    return sse.encode({"error": {"code": code, "message": message, "type": "unavailable_error"}})


def error_text(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)
