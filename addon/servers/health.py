"""A server's `/health`, asked on a connection kept from one question to the next, as a
kept-alive client asks: a loaded server (vLLM answers on the event loop its streams keep
busy) answers a question on an open connection sooner than on a new one.

On the legs' own client, not httpx's: asked every second of every server, in the loop
that carries every stream, a question to a llama-server took 0.7-0.9 ms of CPU by httpx,
0.2 ms here (docs/benchmarks.md)."""

from __future__ import annotations

import asyncio

from addon.servers.kept import KeptPool
from addon.servers.upstream import Upstream, get_request

BODY_LIMIT = 65536


class HealthQuestions:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pool = KeptPool(per_server=1)

    async def status(self, url: str) -> int:
        """The status `url` answers GET /health with. Raises TimeoutError past the
        timeout, Unreachable where it cannot be connected to, UpstreamError where it
        breaks HTTP."""
        upstream = Upstream(url)
        async with asyncio.timeout(self.timeout_s):
            response, _ = await self._pool.ask(
                upstream, get_request(upstream, "/health"), b"", 2 * self.timeout_s, BODY_LIMIT
            )
        return response.status

    def close(self) -> None:
        self._pool.close()
