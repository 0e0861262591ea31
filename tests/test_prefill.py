"""The client's own assistant prefill is the text of its request, and whether the first
server sent it back at the start of the answer is known from the request and the engine
(handoff/seen.py `prefill_echoed`), never guessed from the answer's text, which may
begin with the prefill's own words.

Real llama-servers: what the guess rested on (llama-server streams a plain trailing
message back first, and nothing for `continue_final_message`), and the continuation the
addon builds (handoff/nextleg.py, the code the proxy runs) for an answer that begins as
its prefill did, compared with what the model saw and wrote: the server's own rendering
of the request as sent (`/apply-template`) followed by the answer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx

from addon.formats.chat import Chat
from addon.formats.transcript import Transcript
from addon.handoff.nextleg import NextLeg
from addon.handoff.seen import prefill_echoed
from addon.servers.directory import ServerDirectory
from addon.servers.upstream import Upstream
from scripts.testbed.llamaserver import LlamaServer
from tests.chat_shapes import QUESTION

PLACED = {"continue_final_message": True, "add_generation_prompt": False}


def first_delta(server: LlamaServer, body: dict[str, Any]) -> str:
    """The first content delta of `server`'s own streamed answer to `body`."""
    asked = {**body, "max_tokens": 3, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=asked, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    if content := choice["delta"].get("content"):
                        return content
    raise AssertionError("no content")


def test_llama_server_sends_a_plain_prefill_back_first_and_a_placed_one_not(
    start_server: Callable[..., LlamaServer],
) -> None:
    """What `prefill_echoed` says of llama-server, asked of a real one."""
    server = start_server("fallback")
    prefilled = {"messages": [QUESTION, {"role": "assistant", "content": "The river"}]}
    assert first_delta(server, prefilled).startswith("The river")
    assert not first_delta(server, {**prefilled, **PLACED}).startswith("The river")


def test_an_answer_that_begins_as_its_prefill_did_goes_on_from_every_character(
    start_server: Callable[..., LlamaServer],
) -> None:
    """The client prefills a newline and asks `continue_final_message` (llama-server
    sends nothing back); the model's answer begins with two more. The continuation's
    prompt is the rendering of the request as sent, then all of them: a guess from the
    text took the answer's first newline for an echo, out of the truth and the trailing
    message alike, and the check agreed with a prompt one newline short."""
    server = start_server("fallback")
    answer = "\n\nThe river runs north"
    body = {"messages": [QUESTION, {"role": "assistant", "content": "\n"}], **PLACED,
            "max_tokens": 40, "stream": True, "temperature": 0}  # fmt: skip
    sent = asyncio.run(_continued(server, body, answer))
    rendered = httpx.post(f"{server.url}/apply-template", json=_rendering(body)).json()["prompt"]
    assert sent == rendered + answer, (sent[-30:], rendered[-10:])


async def built_continuation(url: str, body: dict[str, Any], answer: str) -> tuple[str, Any]:
    """(path, body) of the continuation the addon builds on the server at `url` of
    `answer`, cut after its first two chunks (the server's own first leg, as the splice
    records it: its echo as `prefill_echoed` says, its text as delivered)."""
    servers = ServerDirectory()
    upstream = Upstream(url)
    try:
        info = await servers.probe(upstream, True)
        record = Transcript()
        record.begin_leg(url, echoes=prefill_echoed(body, info))
        for text in (answer[:5], answer[5:]):
            record.record({"choices": [{"index": 0, "delta": {"content": text}}]})
        leg = NextLeg("/v1/chat/completions", Chat("messages"), body, record, servers, False)
        path, sent, _, _ = await leg.continuation(upstream)
    finally:
        await servers.close()
    return path, sent


async def _continued(server: LlamaServer, body: dict[str, Any], answer: str) -> str:
    """The prompt `server` reads for the continuation the addon builds of `answer`."""
    path, sent = await built_continuation(server.url, body, answer)
    if path == "/completion":
        return "".join(part for part in sent["prompt"] if isinstance(part, str))
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        return (await client.post("/apply-template", json=_rendering(sent))).json()["prompt"]


def _rendering(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("stream", "max_tokens", "temperature")}
