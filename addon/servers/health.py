"""A server's `/health`, asked on a connection kept from one question to the next, as a
kept-alive client asks: a loaded server (vLLM answers on the event loop its streams keep
busy) answers a question on an open connection sooner than on a new one.

On the legs' own client, not httpx's: asked every second of every server, in the loop
that carries every stream, a question to a llama-server took 0.7-0.9 ms of CPU by httpx,
0.2 ms here (docs/benchmarks.md)."""

from __future__ import annotations

import asyncio

from addon.servers.upstream import (
    Connection,
    Upstream,
    UpstreamError,
    connect,
    get_request,
    send,
)

BODY_LIMIT = 65536


class HealthQuestions:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._kept: dict[str, Connection] = {}  # one per server, between its questions

    async def status(self, url: str) -> int:
        """The status `url` answers GET /health with. Raises TimeoutError past the
        timeout, Unreachable where it cannot be connected to, UpstreamError where it
        breaks HTTP."""
        upstream = Upstream(url)
        kept = self._kept.pop(url, None)
        async with asyncio.timeout(self.timeout_s):
            if kept is not None and kept.open:
                try:
                    return await self._ask(kept, upstream)
                except UpstreamError:
                    pass  # closed by the server as it was asked: asked on a new one
            elif kept is not None:
                kept.close()  # ended by the server, or it wrote unasked
            return await self._ask(await connect(upstream, 2 * self.timeout_s), upstream)

    async def _ask(self, connection: Connection, upstream: Upstream) -> int:
        try:
            response = await send(connection, upstream, get_request(upstream, "/health"))
            await response.read_all(limit=BODY_LIMIT)
        except BaseException:
            connection.close()
            raise
        if response.reusable and upstream.url not in self._kept:
            self._kept[upstream.url] = connection
        else:
            connection.close()
        return response.status

    def close(self) -> None:
        for connection in self._kept.values():
            connection.close()
        self._kept.clear()
