"""The "Spillover SSE" contentview: pure prettify and render_priority checks."""

from __future__ import annotations

import json
from typing import Any

import pytest
from mitmproxy import contentviews
from mitmproxy.contentviews import Metadata
from mitmproxy.test import taddons, tflow

from addon.surface.sseview import NAME, PRIORITY_OTHER_SSE, PRIORITY_SPLICED, RULE, register, view

HEAD = "handoff http://127.0.0.1:8081 -> http://127.0.0.1:8082 after 2 tokens"
DETAILS = "(requested by POST /spillover/handoff), replayed as token ids, first byte after 3.1 ms"
HANDOFF = f"{HEAD} {DETAILS}"
SEPARATOR = ["", f"{RULE} {HEAD} {RULE}", f"       {DETAILS}", ""]


def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
    body = {
        "choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
        "created": 1796038004,
        "id": "chatcmpl-x",
        "model": "primary.gguf",
        "object": "chat.completion.chunk",
    }
    return f"data: {json.dumps(body | extra)}\n\n"


def pretty(body: str) -> list[str]:
    return view.prettify(body.encode(), Metadata(content_type="text/event-stream")).splitlines()


def test_stitched_stream_one_line_per_event() -> None:
    body = (
        chunk({"role": "assistant", "content": None})
        + chunk({"content": "The"})
        + chunk({"content": " river"})
        + f": spillover: {HANDOFF}\n\n"
        + chunk({"content": " flows"})
        + chunk({}, "stop", usage={"prompt_tokens": 5, "completion_tokens": 3})
        + "data: [DONE]\n\n"
    )
    assert pretty(body) == [
        "       (role assistant)",
        '    1  "The"',
        '    2  " river"',
        *SEPARATOR,
        '    3  " flows"',
        "       finish: stop",
        '       usage: {"prompt_tokens":5,"completion_tokens":3}',
        "       [DONE]",
    ]


def test_fields_are_named() -> None:
    call = [{"index": 0, "id": "c1", "function": {"name": "get", "arguments": "{"}}]
    lines = pretty(
        chunk({"reasoning_content": "Let me think"})
        + chunk({"content": "ünïcode\n"})
        + chunk({"tool_calls": call})
    )
    assert lines == [
        '    1  reasoning "Let me think"',
        '    2  "ünïcode\\n"',
        f"    3  tool_calls {json.dumps(call, separators=(',', ':'))}",
    ]


def test_handoff_separator_stands_out() -> None:
    note = f": spillover: {HANDOFF}; the seed cannot be honoured\n\n"
    assert pretty(note) == [
        f"{RULE} {HEAD} {RULE}",
        f"       {DETAILS}; the seed cannot be honoured",
        "",
    ]
    assert pretty(": spillover: handoff a -> b after 1 tokens\n\n") == [
        f"{RULE} handoff a -> b after 1 tokens {RULE}",
        "",
    ]


def test_error_event_is_loud() -> None:
    body = 'data: {"error": {"code": 503, "message": "no slot", "type": "unavailable_error"}}\n\n'
    assert pretty(body) == ["       ✖ ERROR 503 unavailable_error: no slot"]
    assert pretty('data: {"error": "boom"}\n\n') == ['       ✖ ERROR: "boom"']


def test_text_completion_and_other_choice_index() -> None:
    body = 'data: {"choices": [{"index": 1, "text": " hi", "finish_reason": "length"}]}\n\n'
    assert pretty(body) == ['    1  [1] " hi"', "       [1] finish: length"]


@pytest.mark.parametrize(
    "body",
    [
        "data: {not json\n\n",
        "data: [1, 2]\n\n",
        'data: {"choices": "nope"}\n\n',
        'data: {"choices": [null, 3, {"delta": null, "index": "x"}]}\n\n',
        'data: {"choices": [{"delta": {"content": 7, "role": 5}}]}\n\n',
        'data: {"object": "chat.completion.chunk", "choices": []}\n\n',
        "event: ping\nid: 4\n\n",
        ": just a comment\n\n",
    ],
)
def test_unparseable_is_shown_raw(body: str) -> None:
    lines = pretty(body)
    for piece in body.replace("data: ", "").split("\n"):
        if piece.strip():
            assert any(piece.lstrip(": ") in line for line in lines), (piece, lines)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            'data: {"choices": [{"delta": {"tool_calls": {"a": 1}}, "finish_reason": 5}]}\n\n',
            ['    1  tool_calls {"a":1}', "       finish: 5"],
        ),
        (
            'data: {"choices": [{"delta": {"role": []}, "index": null}], "usage": 3}\n\n',
            ["       usage: 3"],
        ),
        (
            'data: {"error": null, "choices": [{"text": 4, "delta": "x"}]}\n\n',
            ['       {"error": null, "choices": [{"text": 4, "delta": "x"}]}'],
        ),
        ("data:\n\n", ["       "]),
        ("\n\n\n", []),
        ("", []),
    ],
)
def test_odd_shapes(body: str, expected: list[str]) -> None:
    assert pretty(body) == expected


def test_binary_garbage_and_crlf() -> None:
    assert view.prettify(b"\xff\xfe\x00data", Metadata())
    assert pretty(chunk({"content": "a"}).replace("\n", "\r\n")) == ['    1  "a"']


def test_render_priority() -> None:
    sse = b'data: {"choices": []}\n\n'
    spliced = tflow.tflow(resp=True)
    spliced.metadata["spillover"] = {"ladder": [], "handoffs": []}
    plain = tflow.tflow(resp=True)
    assert view.render_priority(sse, Metadata(spliced, "text/event-stream")) == PRIORITY_SPLICED
    assert view.render_priority(sse, Metadata(plain, "text/event-stream")) == PRIORITY_OTHER_SSE
    assert view.render_priority(sse, Metadata(None, "text/event-stream")) == PRIORITY_OTHER_SSE
    assert view.render_priority(sse, Metadata(spliced, "application/json")) == 0
    assert view.render_priority(b"", Metadata(spliced, "text/event-stream")) == 0
    assert 0 < PRIORITY_OTHER_SSE < PRIORITY_SPLICED


def test_register_is_idempotent_and_auto_selects() -> None:
    register()
    register()
    assert list(contentviews.registry).count(NAME.lower()) == 1
    assert contentviews.registry[NAME] is view
    flow = tflow.tflow(resp=True)
    flow.metadata["spillover"] = {"ladder": [], "handoffs": []}
    assert flow.response is not None
    flow.response.headers["content-type"] = "text/event-stream; charset=utf-8"
    flow.response.content = (chunk({"content": " x"}) + f": spillover: {HANDOFF}\n\n").encode()
    with taddons.context():  # prettify_message reads ctx.options
        result = contentviews.prettify_message(flow.response, flow)
    assert result.view_name == NAME
    assert result.text.splitlines() == ['    1  " x"', *SEPARATOR]
