"""Connections kept per server for the addon's own questions, on the legs' client (h11 on
an asyncio protocol): `KeptPool` asks on one, and `KeptConnections` is an httpx transport
over it.

httpx's own transport (httpcore and its pool) took 1.27 ms of CPU a directory question to
a llama-server, this 0.60 ms (docs/benchmarks.md); the questions run in the loop that
carries every stream, three of them inside a handoff's pause. Errors come as httpx's,
so a client of it reads them as before."""

from __future__ import annotations

import asyncio

import h11
import httpx

from addon.servers.upstream import (
    Connection,
    Response,
    Unreachable,
    Upstream,
    UpstreamError,
    connect,
    send,
)

BODY_LIMIT = 64 * 1024 * 1024


class KeptPool:
    """Up to `per_server` idle connections kept per server, each taken out while it is
    asked on, so two questions never share one."""

    def __init__(self, per_server: int) -> None:
        self.per_server = per_server
        self._kept: dict[str, list[Connection]] = {}

    async def ask(
        self,
        upstream: Upstream,
        request: h11.Request,
        body: bytes = b"",
        connect_timeout: float = 5.0,
        limit: int = BODY_LIMIT,
    ) -> tuple[Response, bytes]:
        """The response and its whole body. A kept connection the server closed as it was
        asked on is asked on once more, on a new connection. Raises Unreachable and
        UpstreamError; the connection is dropped on any failure."""
        if (kept := self._take(upstream.url)) is not None:
            try:
                return await self._ask_on(kept, upstream, request, body, limit)
            except UpstreamError:
                pass
        connection = await connect(upstream, connect_timeout)
        return await self._ask_on(connection, upstream, request, body, limit)

    async def _ask_on(
        self,
        connection: Connection,
        upstream: Upstream,
        request: h11.Request,
        body: bytes,
        limit: int,
    ) -> tuple[Response, bytes]:
        try:
            response = await send(connection, upstream, request, body)
            content = await response.read_all(limit=limit)
        except BaseException:
            connection.close()
            raise
        kept = self._kept.setdefault(upstream.url, [])
        if response.reusable and len(kept) < self.per_server:
            kept.append(connection)
        else:
            connection.close()
        return response, content

    def _take(self, server: str) -> Connection | None:
        kept = self._kept.get(server) or []
        while kept:
            connection = kept.pop()
            if connection.open:
                return connection
            connection.close()  # ended by the server, or it wrote unasked
        return None

    def close(self) -> None:
        for kept in self._kept.values():
            for connection in kept:
                connection.close()
        self._kept.clear()


class KeptConnections(httpx.AsyncBaseTransport):
    def __init__(self, per_server: int) -> None:
        self._pool = KeptPool(per_server)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        upstream = Upstream(f"{url.scheme}://{url.netloc.decode('ascii')}")
        timeouts = request.extensions.get("timeout", {})
        asked = h11.Request(method=request.method, target=url.raw_path, headers=request.headers.raw)
        body = await request.aread()
        try:
            async with asyncio.timeout(timeouts.get("read")):
                response, content = await self._pool.ask(
                    upstream, asked, body, timeouts.get("connect") or 5.0
                )
        except TimeoutError as exc:
            raise httpx.ReadTimeout(f"no answer from {upstream.url}", request=request) from exc
        except Unreachable as exc:
            timed_out = isinstance(exc.__cause__, TimeoutError)
            kind = httpx.ConnectTimeout if timed_out else httpx.ConnectError
            raise kind(str(exc), request=request) from exc
        except UpstreamError as exc:
            raise httpx.RemoteProtocolError(str(exc), request=request) from exc
        return httpx.Response(response.status, headers=response.headers, content=content)

    async def aclose(self) -> None:
        self._pool.close()
