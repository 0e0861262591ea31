"""A Responses answer whose function call streams after its text (issue 54).

OpenAI's API (and vLLM's, and hosted APIs') closes the message item (`output_text.done`,
`content_part.done`, `output_item.done`) before it adds a `function_call` item and
streams its arguments; the answer ends at `response.completed`. A server that dies or
wedges during those arguments has not finished the answer: it is cut like any other,
and the next server goes on in the message the client still has open.

The primary is a scripted stand-in replaying that order byte for byte (no real engine
here writes it: llama-server adds a call's item while its message is still open). Each
event is framed and its fields ordered as OpenAI's API writes them, as in streams
recorded from it (vercel/ai's Responses fixtures: a gpt-4o-mini message, issue 20047, and
a gpt-5.1 call with its `obfuscation` padding, issue 19493); ids and words are ours. The
next server is a real llama-server, behind a real mitmdump, read by the official
`openai` SDK. The client offers no tools: the call is the stand-in's script, and a tool
list would change what the next server writes after the cut (its tool-call grammar)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.prompts import PROMPT
from scripts.testbed.scripted_upstream import STREAM_HEAD, FakeUpstream, chunked
from tests.streams import continuation

RESPONSE, MESSAGE, CALL = "resp_67ccd2bed1ec8190", "msg_67ccd2bf17f0819", "fc_67ccd3acc8d48190"
WORDS = ["Let", " me", " look", " up", " the", " weather", " in", " Paris", "."]
TEXT = "".join(WORDS)
ARGUMENTS = ['{"', "city", '":"', "Par", "is", '"}']
MAX_TOKENS = 40
WEDGED_S = 30.0  # far past the stall watch's second


def openai_events() -> list[bytes]:
    """The answer as OpenAI streams it: its text, its message closed, then the call."""
    head = {"id": RESPONSE, "object": "response", "created_at": 1741476542,
            "status": "in_progress", "model": "gpt-4o-mini-2024-07-18", "output": [],
            "usage": None}  # fmt: skip
    text = {"type": "output_text", "annotations": [], "logprobs": [], "text": TEXT}
    message = {"id": MESSAGE, "type": "message", "status": "completed", "content": [text],
               "role": "assistant"}  # fmt: skip
    call = {"id": CALL, "type": "function_call", "status": "completed",
            "arguments": "".join(ARGUMENTS), "call_id": "call_12dF5k",
            "name": "get_weather"}  # fmt: skip
    at = {"content_index": 0, "item_id": MESSAGE}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": head},
        {"type": "response.in_progress", "response": head},
        {"type": "response.output_item.added",
         "item": {**message, "status": "in_progress", "content": []}, "output_index": 0},
        {"type": "response.content_part.added", **at, "output_index": 0,
         "part": {**text, "text": ""}},
        *({"type": "response.output_text.delta", "content_index": 0, "delta": word,
           "item_id": MESSAGE, "logprobs": [], "output_index": 0} for word in WORDS),
        {"type": "response.output_text.done", **at, "logprobs": [], "output_index": 0,
         "text": TEXT},
        {"type": "response.content_part.done", **at, "output_index": 0, "part": text},
        {"type": "response.output_item.done", "item": message, "output_index": 0},
        {"type": "response.output_item.added",
         "item": {**call, "status": "in_progress", "arguments": ""}, "output_index": 1},
        *({"type": "response.function_call_arguments.delta", "delta": piece, "item_id": CALL,
           "obfuscation": "H2d0mf8T42i5Ya", "output_index": 1}
          for piece in ARGUMENTS),
        {"type": "response.function_call_arguments.done", "arguments": call["arguments"],
         "item_id": CALL, "output_index": 1},
        {"type": "response.output_item.done", "item": call, "output_index": 1},
        {"type": "response.completed", "response": {
            **head, "status": "completed", "output": [message, call],
            "usage": {"input_tokens": 21, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": 26, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": 47}}},
    ]  # fmt: skip
    return [
        f"event: {e['type']}\ndata: ".encode()
        + json.dumps({**e, "sequence_number": n}, separators=(",", ":")).encode()
        + b"\n\n"
        for n, e in enumerate(events)
    ]


EVENTS = openai_events()
# The stream up to the call's second argument piece: where the stand-ins stop.
MID_CALL = next(n for n, e in enumerate(EVENTS) if b'"delta":"city"' in e) + 1


@pytest.fixture(scope="module")
def fallback(start_server_module) -> LlamaServer:
    # No prompt cache: see test_other_apis.py (these APIs drop llama-server's own field).
    return start_server_module("fallback", extra_args=["--no-cache-prompt"])


def read(url: str) -> list[Any]:
    """The events of the answer as the openai SDK reads them."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=20)
    stream = client.responses.create(
        model="gpt-4o-mini", input=PROMPT[0]["content"], max_output_tokens=MAX_TOKENS,
        stream=True, temperature=0,
    )  # fmt: skip
    return list(stream)


def test_the_answer_in_openais_order_goes_out_as_sent(start_proxy, fallback) -> None:
    primary = FakeUpstream([(STREAM_HEAD + chunked(*EVENTS) + b"0\r\n\r\n", 0)])
    proxy = start_proxy(primary.url, [fallback.url])
    body = {"model": "gpt-4o-mini", "input": PROMPT[0]["content"], "stream": True,
            "max_output_tokens": MAX_TOKENS}  # fmt: skip
    with httpx.stream("POST", f"{proxy.url}/v1/responses", json=body, timeout=20) as reply:
        assert reply.read() == b"".join(EVENTS)  # byte for byte
    completed = read(proxy.url)[-1].response
    assert [item.type for item in completed.output] == ["message", "function_call"]
    assert completed.output[1].arguments == '{"city":"Paris"}'
    primary.close()


@pytest.mark.parametrize(
    ("how", "script"),
    [
        # A gateway in front of a server that died ends the stream cleanly...
        ("ended", [(STREAM_HEAD + chunked(*EVENTS[:MID_CALL]) + b"0\r\n\r\n", 0)]),
        # ...the server itself drops the connection mid-body...
        ("dropped", [(STREAM_HEAD + chunked(*EVENTS[:MID_CALL]), 0)]),
        # ...or it wedges there and sends nothing more.
        ("wedged", [(STREAM_HEAD + chunked(*EVENTS[:MID_CALL]), WEDGED_S)]),
    ],
)
def test_a_server_lost_inside_a_call_after_its_text_hands_the_answer_off(
    start_proxy, fallback, how: str, script: list
) -> None:
    """The call was never sent whole, so the client never gets it; the next server goes
    on from the text, in the message the client still has open: one message, its text
    the stand-in's and then exactly the next server's own continuation of it."""
    primary = FakeUpstream(script)
    quick = ["spillover_stall_s=1", "spillover_first_token_s=2"]
    proxy = start_proxy(primary.url, [fallback.url], options=quick)
    proxy.servers_known()  # the fallback is proven to continue before the answer starts
    events = read(proxy.url)
    kinds = [e.type for e in events]
    handoffs = httpx.get(f"{proxy.url}/spillover/status").json()["recent_handoffs"]
    assert handoffs, f"no handoff: the client got {kinds}"
    cut = handoffs[-1]
    assert cut["kind"] == ("stalled" if how == "wedged" else "failure"), cut
    assert cut["at_char"] == len(TEXT) and cut["at_token"] == len(WORDS)
    for kind in ("response.output_item.added", "response.output_text.done",
                 "response.content_part.done", "response.output_item.done"):  # fmt: skip
        assert kinds.count(kind) == 1, (kind, kinds)
    assert "response.function_call_arguments.delta" not in kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    after = continuation(fallback.url, TEXT, MAX_TOKENS - len(WORDS))
    assert text == TEXT + after and after
    completed = events[-1]
    assert completed.type == "response.completed" and completed.response.id == RESPONSE
    (message,) = completed.response.output
    assert message.id == MESSAGE and message.content[0].text == text
    primary.close()
