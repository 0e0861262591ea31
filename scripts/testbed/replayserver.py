"""A stand-in for one recorded upstream server: answers what the addon asks with what
that server answered in the recording, and ends each answer the way it ended then.

mitmproxy's own server replay sends a recorded response whole; a recorded leg must also
stop where it was cut (the server stalls until the addon hangs up) or die the way it
died (the connection drops mid-body), so the cut lands exactly where it landed.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from mitmproxy import http

SKIPPED_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive"}
DIED_MID_BODY = ("closed mid-body", "connection lost", "closed the stream mid-answer")


@dataclass
class Recorded:
    flow: http.HTTPFlow
    served: bool = False
    sent: asyncio.Event = field(default_factory=asyncio.Event)  # all its bytes are out
    asked_with: bytes | None = None  # the request body the current addon sent

    @property
    def meta(self) -> dict:
        return self.flow.metadata["spillover_exchange"]

    def matches(self, method: str, path: str) -> bool:
        request = self.flow.request
        return request.method == method and request.path == path


class ReplayServer:
    def __init__(self, exchanges: list[http.HTTPFlow]) -> None:
        self.exchanges = [Recorded(flow) for flow in exchanges]
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    def pick(self, method: str, path: str, body: bytes) -> Recorded | None:
        """The recorded exchange this request stands for: the first unserved one with the
        same method, path and body; else (a leg the current addon asks differently) the
        first unserved one with the same method and path; else a question asked again."""
        candidates = [r for r in self.exchanges if r.matches(method, path)]
        for pool in (
            [r for r in candidates if not r.served and r.flow.request.content == body],
            [r for r in candidates if not r.served and r.meta["purpose"] == "leg"],
            [r for r in candidates if r.flow.request.content == body],
            [r for r in candidates if r.meta["purpose"] == "question"],
        ):
            if pool:
                return pool[0]
        return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            method, path = head.split(b" ")[:2]
            length = next(
                (
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ),
                0,
            )
            body = await reader.readexactly(length)
            recorded = self.pick(method.decode(), path.decode(), body)
            if recorded is None:
                writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                return
            recorded.served = True
            recorded.asked_with = body
            await self._answer(recorded, reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def _answer(
        self, recorded: Recorded, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        response = recorded.flow.response
        meta = recorded.meta
        if response is None:  # it failed before answering: hang up without a word
            recorded.sent.set()
            return
        head = [f"HTTP/1.1 {response.status_code} {response.reason or 'OK'}"]
        head += [
            f"{k}: {v}" for k, v in response.headers.items() if k.lower() not in SKIPPED_HEADERS
        ]
        head += ["transfer-encoding: chunked", "connection: close"]
        content = response.raw_content or b""
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
        if content:
            writer.write(b"%x\r\n%s\r\n" % (len(content), content))
        await writer.drain()
        recorded.sent.set()
        if meta["outcome"] in ("handed off", "cancelled"):
            await reader.read()  # stall where the cut came, until the addon hangs up
            return
        if meta["outcome"] == "failed" and any(d in (meta["error"] or "") for d in DIED_MID_BODY):
            writer.transport.abort()  # died mid-answer
            return
        writer.write(b"0\r\n\r\n")
        await writer.drain()


def request_difference(recorded: Recorded) -> str | None:
    """How the current addon's request for a leg differs from the recorded one."""
    if recorded.asked_with is None or recorded.meta["purpose"] != "leg":
        return None
    before = recorded.flow.request.content or b""
    if recorded.asked_with == before:
        return None
    try:
        old, new = json.loads(before), json.loads(recorded.asked_with)
    except ValueError:
        return f"leg {recorded.meta['leg']}: request body differs"
    if old == new:
        return None  # written another way (spaces, the order of its keys): the same request
    if not isinstance(old, dict) or not isinstance(new, dict):
        return f"leg {recorded.meta['leg']}: request body differs"
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    return f"leg {recorded.meta['leg']} request differs in {', '.join(changed)}"
