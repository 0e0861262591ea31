"""The /health questions keep one connection per server, as a kept-alive client does, and
ask on a new one whenever the kept one cannot carry another question. The server here is
a stand-in (an asyncio server of a few lines): how many connections a client opened, and
a connection dropped just as it is asked on, are what no real server shows or does on
demand. Real llama-servers and vLLMs answer the same questions in test_routing.py and
test_vllm*.py."""

from __future__ import annotations

import asyncio

import pytest

from addon.servers.health import HealthQuestions
from addon.servers.upstream import Unreachable

OK = b'{"status":"ok"}'


class Server:
    """Answers each GET with `status`; `mode`: "keep" (keeps the connection), "close"
    (says `Connection: close`), "silent" (closes it after answering, saying nothing),
    "drop-reused" (closes a connection asked on a second time, without an answer),
    "unasked" (writes more right after its answer, and keeps the connection), or
    "unasked-later" (the same a moment after it)."""

    def __init__(self, mode: str = "keep", status: int = 200) -> None:
        self.mode, self.status = mode, status
        self.connections = 0
        self.closed_by_client = 0

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        asked = 0
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                asked += 1
                if self.mode == "drop-reused" and asked > 1:
                    break
                close = b"connection: close\r\n" if self.mode == "close" else b""
                writer.write(
                    b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n%s\r\n%s"
                    % (self.status, len(OK), close, OK)
                )
                await writer.drain()
                if self.mode == "unasked-later":
                    await asyncio.sleep(0.005)  # (the answer read alone first)
                if self.mode.startswith("unasked"):
                    writer.write(b"more")
                if self.mode in ("close", "silent"):
                    break
        except asyncio.IncompleteReadError:
            self.closed_by_client += 1
        writer.close()

    async def stop(self) -> None:
        """Stop listening, once every connection is closed (a connection the client left
        open fails this)."""
        self._server.close()
        await asyncio.wait_for(self._server.wait_closed(), 2)


async def ask(server: Server, times: int) -> list[int]:
    url, questions = await server.start(), HealthQuestions(1.0)
    try:
        answers = []
        for _ in range(times):
            answers.append(await questions.status(url))
            await asyncio.sleep(0.02)  # (a server's close arrives before the next question)
        return answers
    finally:
        questions.close()
        await server.stop()


def test_questions_to_a_server_go_on_one_kept_connection() -> None:
    server = Server("keep")
    assert asyncio.run(ask(server, 5)) == [200] * 5
    assert server.connections == 1


@pytest.mark.parametrize("mode", ["close", "silent", "drop-reused"])
def test_a_connection_the_server_ends_is_not_asked_on_again(mode: str) -> None:
    server = Server(mode)
    # drop-reused: each question after the first is dropped on the kept connection, and
    # asked again on a new one
    assert asyncio.run(ask(server, 4)) == [200] * 4
    assert server.connections == 4


@pytest.mark.parametrize("mode", ["unasked", "unasked-later"])
def test_a_connection_the_server_wrote_more_on_is_closed_not_kept(mode: str) -> None:
    server = Server(mode)
    assert asyncio.run(ask(server, 4)) == [200] * 4
    assert server.connections == 4
    assert server.closed_by_client == 4  # three as the next question came, the last at close


def test_a_status_is_given_as_the_server_said_it() -> None:
    assert asyncio.run(ask(Server("keep", status=503), 2)) == [503, 503]


def test_nothing_listening_is_unreachable() -> None:
    async def refused() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        await HealthQuestions(1.0).status(f"http://127.0.0.1:{port}")

    with pytest.raises(Unreachable, match="refused"):
        asyncio.run(refused())
