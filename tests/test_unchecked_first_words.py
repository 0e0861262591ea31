"""A server the addon cannot ask what it reads (proven by its behaviour, or declared) is
checked at the moment of use by its continuation's first words alone
(formats/startover.py). Where those cannot show anything, the answer does not go there
and ends in-band saying so: a Messages answer (its events are not held and read), and a
chat answer under twelve characters (too short to tell a continuation from the answer
started over). Scripted stand-ins: no real server here is a hosted API."""

from __future__ import annotations

import json
from typing import Any

import httpx

from scripts.testbed.openai_upstream import OpenAIUpstream
from scripts.testbed.prompts import PROMPT, chat_body
from scripts.testbed.scripted_upstream import STREAM_HEAD, FakeUpstream, chunked, sse_chunk
from tests.streams import read_stream

BEHAVIOUR = "proven by its behaviour only"


def hosted_fallback(start_proxy, primary: str) -> tuple[OpenAIUpstream, Any]:
    """A hosted API that continues (the probe proves it by its behaviour), behind a
    primary that dies mid-answer."""
    hosted = OpenAIUpstream("hosted", mode="continue")
    proxy = start_proxy(primary, [hosted.url])
    info = proxy.servers_known()[hosted.url]
    assert info["continues"] is True and info["proof"] == "behaviour", info
    return hosted, proxy


def dying(*events: bytes) -> FakeUpstream:
    """A primary that sends these events and closes the connection mid-answer."""
    return FakeUpstream([(STREAM_HEAD + chunked(*events), 0)])


def test_a_short_chat_answer_does_not_go_to_a_server_checked_by_first_words(start_proxy) -> None:
    primary = dying(sse_chunk(role=True), sse_chunk(" Hi"), sse_chunk(" there"))
    hosted, proxy = hosted_fallback(start_proxy, primary.url)
    stream = read_stream(proxy.url, chat_body(40))
    assert stream.text == " Hi there"
    message = stream.errors[0]["error"]["message"]
    assert f"{hosted.url} is {BEHAVIOUR}, and the answer so far is under 12" in message, message
    assert len(hosted.requests) == 2  # the probe's: no continuation was sent there
    primary.close()
    hosted.close()


def test_a_long_enough_chat_answer_goes_on_there(start_proxy) -> None:
    primary = dying(sse_chunk(role=True), sse_chunk(" Hi there,"), sse_chunk(" river"))
    hosted, proxy = hosted_fallback(start_proxy, primary.url)
    stream = read_stream(proxy.url, chat_body(40))
    assert not stream.errors and stream.segments[0] == " Hi there, river"
    assert BEHAVIOUR in stream.notes[0] and stream.segments[1]
    primary.close()
    hosted.close()


def test_a_messages_answer_does_not_go_to_a_server_checked_by_first_words(start_proxy) -> None:
    start = {"type": "message_start", "message": {"id": "msg_1", "type": "message",
             "role": "assistant", "content": [], "model": "scripted", "usage": {}}}  # fmt: skip
    block = {"type": "content_block_start", "index": 0,
             "content_block": {"type": "text", "text": ""}}  # fmt: skip
    delta = {"type": "content_block_delta", "index": 0,
             "delta": {"type": "text_delta", "text": " the river ran under"}}  # fmt: skip
    events = [
        f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in (start, block, delta)
    ]
    primary = dying(*events)
    hosted, proxy = hosted_fallback(start_proxy, primary.url)
    body = {"model": "m", "max_tokens": 40, "messages": PROMPT, "stream": True}
    with httpx.stream("POST", f"{proxy.url}/v1/messages", json=body, timeout=60) as r:
        data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1]["type"] == "error", data[-2:]
    message = data[-1]["error"]["message"]
    assert f"{hosted.url} is {BEHAVIOUR}, and first words are checked in chat" in message
    assert len(hosted.requests) == 2  # the probe's
    primary.close()
    hosted.close()
