"""The addon's questions go through httpx on the legs' own connections
(`servers/kept.py`): a few kept per server, and httpx's errors as before. The server is
the stand-in of test_health_questions.py (connections counted); the directory's real
questions to real llama-servers and vLLMs run through it in the rest of the suite."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from addon.servers.kept import KeptConnections
from tests.test_health_questions import OK, Server


async def questions(server: Server, rounds: int, at_once: int) -> list[bytes]:
    url = await server.start()
    answers = []
    try:
        async with httpx.AsyncClient(timeout=2, transport=KeptConnections(2)) as client:
            for _ in range(rounds):
                asked = [client.get(f"{url}/props") for _ in range(at_once)]
                answers += [response.content for response in await asyncio.gather(*asked)]
    finally:
        await server.stop()
    return answers


def test_questions_one_after_another_go_on_one_connection() -> None:
    server = Server("keep")
    assert asyncio.run(questions(server, 5, 1)) == [OK] * 5
    assert server.connections == 1


def test_questions_at_once_keep_as_many_connections_as_allowed() -> None:
    server = Server("keep")
    assert asyncio.run(questions(server, 3, 3)) == [OK] * 9
    assert server.connections == 3 + 1 + 1  # two kept after each burst, one more opened


@pytest.mark.parametrize("mode", ["silent", "drop-reused"])
def test_a_connection_the_server_ends_is_not_asked_on_again(mode: str) -> None:
    """drop-reused: each question after the first is dropped on the kept connection, and
    asked again on a new one (shadows and migrations have no other retry)."""
    server = Server(mode)
    assert asyncio.run(questions(server, 3, 1)) == [OK] * 3
    assert server.connections == 3


def test_errors_are_httpxs() -> None:
    async def ask(url: str, timeout: float) -> None:
        async with httpx.AsyncClient(timeout=timeout, transport=KeptConnections(2)) as client:
            await client.get(f"{url}/props")

    async def refused() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        await ask(f"http://127.0.0.1:{port}", 2)

    async def silent() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        try:
            await ask(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", 0.2)
        finally:
            server.close()

    with pytest.raises(httpx.ConnectError):
        asyncio.run(refused())
    with pytest.raises(httpx.ReadTimeout):
        asyncio.run(silent())
