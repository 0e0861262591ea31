"""An httpx transport on the legs' own client (h11 on an asyncio protocol), for the
addon's questions: a few connections kept per server, each question's answer read whole.

httpx's own transport (httpcore and its pool) took 1.27 ms of CPU a directory question to
a llama-server, this 0.60 ms (docs/benchmarks.md); the questions run in the loop that
carries every stream, three of them inside a handoff's pause. Errors come as httpx's,
so a client of it reads them as before."""

from __future__ import annotations

import asyncio

import h11
import httpx

from addon.servers.upstream import Connection, Unreachable, Upstream, UpstreamError, connect, send

BODY_LIMIT = 64 * 1024 * 1024


class KeptConnections(httpx.AsyncBaseTransport):
    def __init__(self, per_server: int) -> None:
        self.per_server = per_server
        self._kept: dict[str, list[Connection]] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        upstream = Upstream(f"{url.scheme}://{url.netloc.decode('ascii')}")
        timeouts = request.extensions.get("timeout", {})
        asked = h11.Request(method=request.method, target=url.raw_path, headers=request.headers.raw)
        body = await request.aread()
        try:
            async with asyncio.timeout(timeouts.get("read")):
                connection = self._take(upstream.url) or await connect(
                    upstream, timeouts.get("connect") or 5.0
                )
                try:
                    response = await send(connection, upstream, asked, body)
                    content = await response.read_all(limit=BODY_LIMIT)
                except BaseException:
                    connection.close()
                    raise
        except TimeoutError as exc:
            raise httpx.ReadTimeout(f"no answer from {upstream.url}", request=request) from exc
        except Unreachable as exc:
            kind = httpx.ConnectTimeout if exc.reason == "timed out" else httpx.ConnectError
            raise kind(str(exc), request=request) from exc
        except UpstreamError as exc:
            raise httpx.RemoteProtocolError(str(exc), request=request) from exc
        self._keep(upstream.url, connection, response.reusable)
        return httpx.Response(response.status, headers=response.headers, content=content)

    def _take(self, server: str) -> Connection | None:
        kept = self._kept.get(server) or []
        while kept:
            connection = kept.pop()
            if connection.open:
                return connection
            connection.close()
        return None

    def _keep(self, server: str, connection: Connection, reusable: bool) -> None:
        kept = self._kept.setdefault(server, [])
        if reusable and len(kept) < self.per_server:
            kept.append(connection)
        else:
            connection.close()

    async def aclose(self) -> None:
        for kept in self._kept.values():
            for connection in kept:
                connection.close()
        self._kept.clear()
