"""A tool call written after a handoff by a fallback the addon cannot ask what it reads
(declared by its operator, or proven by its behaviour alone) reaches the client whole
(issue 54). Its continuation's first words are held until they show it went on
(formats/startover.py); one that goes straight to a call has no words, and the guard
holds it to its end: the call must come out of the hold with it, not the finish alone.

The primary is a real llama-server with llama.cpp's Qwen 2.5 template, offered a tool it
does not call (the tiny model writes words), cut by an asked handoff; the client is the
official `openai` SDK. The fallback is a scripted OpenAI-compatible stand-in
(scripts/testbed/openai_upstream.py, `calls`): no real server here is a hosted API, and
no tiny model goes straight to a call after a partial answer on its own."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from scripts.testbed.llamacppfiles import templates
from scripts.testbed.mitm import Mitmdump
from scripts.testbed.openai_upstream import OpenAIUpstream, call_arguments
from tests.streams import read_stream
from tests.test_raw_output import SAME_BATCHES
from tests.test_splice import handoff
from tests.test_tool_calls import QUESTION, QWEN25, TOOLS
from tests.throttle import Throttled

ANSWER = 100
CUT = 8  # chunks: the role, then 7 words


def read_with_a_handoff(proxy: Mitmdump, primary_pid: int) -> dict[str, Any]:
    """The answer through the proxy as the openai SDK reads it, a handoff asked at the
    CUT-th chunk (the primary throttled, and held while it is asked)."""
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="none", max_retries=0)
    text, calls, finishes = "", {}, []
    with Throttled(primary_pid) as throttle:
        stream = client.chat.completions.create(
            model="tiny", messages=QUESTION, tools=TOOLS, max_tokens=ANSWER, stream=True,
            temperature=0,
        )  # fmt: skip
        for number, chunk in enumerate(stream, 1):
            if number == CUT:
                with throttle.held():
                    assert handoff(proxy, reason="test pressure") == 1
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finishes += [choice.finish_reason] if choice.finish_reason else []
                for piece in choice.delta.tool_calls or ():
                    call = calls.setdefault(piece.index, {"ids": [], "name": "", "arguments": ""})
                    call["ids"] += [piece.id] if piece.id else []
                    call["name"] += piece.function.name or "" if piece.function else ""
                    call["arguments"] += piece.function.arguments or "" if piece.function else ""
    return {"text": text, "calls": calls, "finishes": finishes}


@pytest.mark.parametrize("way", ["message", "message-echoed"])
def test_a_call_a_declared_fallback_goes_straight_to_reaches_the_client_whole(
    start_server, start_proxy, way: str
) -> None:
    template = next(t for t in templates() if t.stem == QWEN25)
    primary = start_server(
        "primary", extra_args=["--jinja", "--chat-template-file", str(template), *SAME_BATCHES]
    )
    mode = "echo" if way == "message-echoed" else "continue"
    hosted = OpenAIUpstream("hosted", mode=mode, calls=True)
    proxy = start_proxy(
        primary.url, [hosted.url], options=[f"spillover_continue_by={hosted.url}={way}"]
    )
    info = proxy.servers_known()[hosted.url]
    assert info["declared"] == way and info["continues"] is True, info
    try:
        got = read_with_a_handoff(proxy, primary.pid)
    finally:
        hosted.close()
    (cut,) = httpx.get(f"{proxy.url}/spillover/status").json()["recent_handoffs"]
    assert cut["target"] == hosted.url and cut["at_char"] == len(got["text"]) > 12, cut
    # The words are the primary's up to the cut, and the fallback was asked to go on
    # from exactly them, with the client's tools.
    alone = read_stream(primary.url, {"messages": QUESTION, "tools": TOOLS, "stream": True,
                                      "max_tokens": ANSWER, "temperature": 0})  # fmt: skip
    assert alone.text.startswith(got["text"]) and alone.finishes == ["length"]
    asked = hosted.requests[-1]
    assert asked["messages"][-1] == {"role": "assistant", "content": got["text"]}
    assert asked["tools"] == TOOLS
    # Its call, whole: one id, its name, its arguments as it wrote them; nothing echoed.
    arguments = call_arguments(TOOLS[0]["function"])
    assert got["calls"] == {
        0: {"ids": ["call_1"], "name": "get_weather", "arguments": arguments}
    }, got["calls"]
    assert got["finishes"] == ["tool_calls"]
