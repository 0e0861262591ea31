"""The behaviour probe sends part of a server's own answer back as a trailing message:
an answer holding half a character (a lone surrogate, which a server can send as a JSON
escape; no real server here writes one on demand, so the server is a function) is cut
before it, and the question goes out as JSON (httpx's own encoding, which refuses a lone
surrogate)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from addon.servers.behaviour import behaviour

WHOLE = "1, 2, \ud83d 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13"


def test_an_answer_with_half_a_character_is_cut_before_it() -> None:
    asked: list[Any] = []

    async def ask(path: str, body: Any) -> Any:
        httpx.Request("POST", f"http://127.0.0.1{path}", json=body)  # as the client sends it
        asked.append(body)
        prefill = body["messages"][1]["content"] if len(body["messages"]) > 1 else ""
        text = WHOLE[len(prefill) :] if prefill else WHOLE
        return {"choices": [{"message": {"role": "assistant", "content": text}}]}

    found = asyncio.run(behaviour(ask, None))
    assert found.continues, found.why
    prefill = asked[1]["messages"][1]["content"]
    assert prefill and "\ud83d" not in prefill
