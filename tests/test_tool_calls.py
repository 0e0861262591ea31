"""Tool calls across a handoff, on real llama-servers with llama.cpp's real chat templates
behind a real proxy (issue 50).

The tiny models never write a tool call on their own; llama-server's `tool_choice:
"required"` makes them (a grammar over the template's call format, with content allowed
before the call), given a tool whose argument is an enum (so the call closes) and, for
Llama 3.1, whose call opens with `{`, a logit bias on that character (the primary then
writes 28 words and one call). What the client must get in each case:

- cut before the call: the rest exactly as the next server goes on from what the model
  wrote, its parser turning the call into `tool_calls` deltas (never markup in content);
- cut inside the call's arguments: the call was never sent (calls go out whole), so the
  next server goes on from the words before it and writes the call whole;
- cut after a whole call was sent: what the model wrote for it is not known byte for
  byte (llama-server's parser hides the call's tokens from every chunk), so the answer
  ends in-band with the reason, or, on a pressure handoff, stays where it is.

Each call the client gets has one index, one id, one name and arguments that are the
JSON the model wrote. Through the Responses API too, where a call is an item of its own
whose events llama-server interleaves with the message's (each call's item added once,
its argument deltas, closed once; the message closed once).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from scripts.testbed.llamacppfiles import templates
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.mitm import Mitmdump
from tests.streams import RawStream, assert_one_clean_stream, read_stream
from tests.tap import Tap, tapped
from tests.test_raw_output import SAME_BATCHES, pieces, text_of, truth
from tests.test_splice import handoff, handoff_after

LLAMA31 = "meta-llama-Llama-3.1-8B-Instruct"
FUNCTIONARY = "meetkai-functionary-medium-v3.2"
QWEN25 = "Qwen-Qwen2.5-7B-Instruct"
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                       "required": ["city"]},
    },
}]  # fmt: skip
QUESTION = [{"role": "user", "content": "Tell me about the river."}]
REQUIRED = {"tool_choice": "required"}
WORDS_THEN_CALL = {**REQUIRED, "logit_bias": [["{", 15]]}  # Llama 3.1: 28 words, a call
ANSWER = 100
CUT = 8  # chunks: the role, then 7 words


def body_of(extra: dict[str, Any]) -> dict[str, Any]:
    return {"messages": QUESTION, "tools": TOOLS, "max_tokens": ANSWER, "stream": True,
            "temperature": 0, **extra}  # fmt: skip


Start = Callable[[str, str], tuple[LlamaServer, LlamaServer, Mitmdump, Tap]]


@pytest.fixture
def tapped_pair(
    start_server: Callable[..., LlamaServer], start_proxy: Callable[..., Mitmdump]
) -> Iterator[Start]:
    """(primary, fallback, proxy, tap): the proxy reaches the primary through the tap."""
    by_name = {template.stem: template for template in templates()}
    taps = ExitStack()

    def start(template: str, fallback: str) -> tuple[LlamaServer, LlamaServer, Mitmdump, Tap]:
        args = ["--jinja", "--chat-template-file", str(by_name[template]), *SAME_BATCHES]
        first = start_server("primary", extra_args=args)
        second = start_server(fallback, extra_args=args)
        tap = taps.enter_context(tapped(first.port))
        proxy = start_proxy(tap.url, [second.url])
        proxy.servers_known()
        return first, second, proxy, tap

    with taps:
        yield start


def calls_of(stream: RawStream) -> list[tuple[str, str]]:
    """The tool calls the client got, (name, arguments) by index, each checked well
    formed: its first delta names its id and function, no later one another id, and its
    arguments, put together, are JSON."""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in stream.chunks:
        for choice in chunk["choices"]:
            for piece in (choice.get("delta") or {}).get("tool_calls") or ():
                function = piece.get("function") or {}
                call = calls.get(piece["index"])
                if call is None:
                    assert piece.get("id") and function.get("name"), piece
                    call = calls[piece["index"]] = {"id": piece["id"], "name": function["name"],
                                                    "arguments": ""}  # fmt: skip
                assert piece.get("id") in (None, call["id"]), "a second id for one call"
                call["arguments"] += function.get("arguments") or ""
    assert sorted(calls) == list(range(len(calls))), "indexes from 0, none missing"
    found = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    for _, arguments in found:
        json.loads(arguments)
    return found


def no_markup(stream: RawStream) -> None:
    for marker in ('"name"', '"parameters"', ">>>", "get_weather"):
        assert marker not in stream.text, f"call markup in content: {stream.text!r}"


def test_a_call_after_the_cut_comes_as_tool_calls_as_the_primary_would_have_sent_it(
    tapped_pair: Start,
) -> None:
    """Cut in the words before the call; the fallback is the same model, so the answer
    the client gets is the primary's own, call and all."""
    first, _, proxy, _ = tapped_pair(LLAMA31, "primary")
    body = body_of(WORDS_THEN_CALL)
    alone = read_stream(first.url, body)
    assert alone.text and calls_of(alone), "the primary writes words, then a call"
    stream = read_stream(proxy.url, body, on_chunk=handoff_after(proxy, CUT, hold=first))
    assert_one_clean_stream(stream)
    assert len(stream.notes) == 1 and "replayed as text" in stream.notes[0], stream.notes
    assert stream.segments[0] and stream.segments[1]
    assert stream.text == alone.text
    assert calls_of(stream) == calls_of(alone)
    assert stream.finishes == ["tool_calls"]
    no_markup(stream)


@pytest.mark.parametrize(("template", "extra"), [(LLAMA31, WORDS_THEN_CALL), (QWEN25, {})])
def test_a_cut_before_any_call_goes_on_as_the_fallback_continues_what_the_model_wrote(
    tapped_pair: Start, template: str, extra: dict[str, Any]
) -> None:
    """Another model behind the cut: what follows is the fallback's own continuation of
    its rendering of the request and what the primary wrote, asked of it directly."""
    first, second, proxy, _ = tapped_pair(template, "fallback")
    body = body_of(extra)
    wrote = pieces(first, body)
    stream = read_stream(proxy.url, body, on_chunk=handoff_after(proxy, CUT, hold=first))
    assert_one_clean_stream(stream)
    said = stream.segment_tokens[0]
    assert text_of(wrote[:said]).lstrip() == stream.segments[0]
    prompt = truth(second, body, wrote[:said], stream.notes[0])
    asked = {"prompt": prompt, "n_predict": ANSWER - said, "temperature": 0,
             "cache_prompt": False, "logit_bias": body.get("logit_bias", [])}  # fmt: skip
    expected = httpx.post(f"{second.url}/completion", json=asked, timeout=60).json()
    assert stream.segments[1] == expected["content"] and expected["content"]
    assert not calls_of(stream)
    no_markup(stream)


def test_a_call_cut_inside_its_arguments_is_written_again_whole(tapped_pair: Start) -> None:
    """The primary dies three argument pieces into its call: the client had the words
    before it and nothing of the call, and the fallback (the same model) goes on from
    those words, writing the call whole, as the primary alone did."""
    first, _, proxy, tap = tapped_pair(LLAMA31, "primary")
    body = body_of(WORDS_THEN_CALL)
    alone = read_stream(first.url, body)
    tap.arm(lambda seen: seen.count(b'"arguments"') >= 3, first.kill)
    stream = read_stream(proxy.url, body)
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    words = len(alone.segments[0].split())
    assert f"after {words} tokens" in note and "replayed as text" in note, note
    assert stream.segments[1] == "", "the primary had sent every word before the call"
    assert stream.text == alone.text
    assert calls_of(stream) == calls_of(alone)
    no_markup(stream)


@pytest.mark.parametrize("cut", ["failure", "pressure"])
def test_after_a_whole_call_the_answer_ends_in_band_or_stays(tapped_pair: Start, cut: str) -> None:
    """Functionary v3.2 writes calls one after another. The client has the first whole
    (sent when the second began) when the primary dies, or a handoff is asked: no server
    can be asked to read the first call as the model wrote it, so a failure ends the
    answer in-band with that reason, and a pressure handoff leaves it where it is."""
    first, _, proxy, tap = tapped_pair(FUNCTIONARY, "primary")
    body = body_of(REQUIRED)
    alone = read_stream(first.url, body)
    assert len(calls_of(alone)) > 1

    stopped = lambda: os.kill(first.pid, signal.SIGSTOP)  # noqa: E731
    tap.arm(lambda seen: b'"index":1' in seen, first.kill if cut == "failure" else stopped)

    def on_chunk(n: int) -> None:
        if cut == "pressure" and n == 2:  # the role, then the first call
            try:
                assert handoff(proxy, reason="test pressure") == 0
            finally:
                os.kill(first.pid, signal.SIGCONT)

    stream = read_stream(proxy.url, body, on_chunk=on_chunk)
    if cut == "pressure":
        assert_one_clean_stream(stream)
        assert not stream.notes and calls_of(stream) == calls_of(alone)
        return
    (error,) = stream.errors
    assert "tool_calls" in error["error"]["message"], error
    assert calls_of(stream) == calls_of(alone)[:1] and stream.done == 0


def test_a_first_call_cut_before_anything_was_sent_starts_over_on_the_fallback(
    tapped_pair: Start,
) -> None:
    """The primary dies inside its first call: the client has had the role and nothing
    else, so the answer starts over on the fallback (another model), which writes its own
    whole, within what is left of the budget (the primary's tokens count)."""
    first, second, proxy, tap = tapped_pair(FUNCTIONARY, "fallback")
    body = body_of(REQUIRED)
    tap.arm(lambda seen: seen.count(b'"arguments"') >= 3, first.kill)
    stream = read_stream(proxy.url, body)
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert "replayed" not in note, note
    spent = int(note.split(" after ")[1].split()[0])
    alone = read_stream(second.url, {**body, "max_tokens": ANSWER - spent})
    assert calls_of(stream) == calls_of(alone) and stream.text == alone.text
    no_markup(stream)


# The same through OpenAI's Responses API (llama-server's /v1/responses): a call is an
# item of its own, whose events llama-server interleaves with the message's.
RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]


class Response:
    """A Responses stream as the client read it: its events, notes and errors."""

    def __init__(self, url: str, body: dict[str, Any], on_text: Callable[[int], None]) -> None:
        self.events: list[dict[str, Any]] = []
        self.notes: list[str] = []
        texts = 0
        with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=60) as reply:
            for line in reply.iter_lines():
                if line.startswith(":"):
                    self.notes.append(line)
                elif line.startswith("data:"):
                    self.events.append(json.loads(line[5:]))
                    if self.events[-1]["type"] == "response.output_text.delta":
                        texts += 1
                        on_text(texts)

    @property
    def text(self) -> str:
        deltas = (e for e in self.events if e["type"] == "response.output_text.delta")
        return "".join(e["delta"] for e in deltas)

    def calls(self) -> list[tuple[str, str]]:
        """The function calls, (name, arguments) in the order they closed, each checked
        well formed: every item added once and closed once, a call's argument deltas
        (between the two) put together its closing arguments, and those JSON."""
        added: dict[str, dict[str, Any]] = {}
        done: list[str] = []
        for event in self.events:
            kind, item = event["type"], event.get("item") or {}
            if kind == "response.output_item.added":
                assert item["id"] not in added, f"{item['id']} added twice"
                added[item["id"]] = {**item, "arguments": ""}
            elif kind == "response.function_call_arguments.delta":
                assert event["item_id"] in added and event["item_id"] not in done, event
                added[event["item_id"]]["arguments"] += event["delta"]
            elif kind == "response.output_item.done":
                assert item["id"] in added and item["id"] not in done, f"{item['id']} closed"
                done.append(item["id"])
                if item["type"] == "function_call":
                    assert added[item["id"]]["arguments"] == item["arguments"], item
                    json.loads(item["arguments"])
        assert sorted(done) == sorted(added), "every item closed"
        calls = [added[i] for i in done if added[i]["type"] == "function_call"]
        return [(call["name"], call["arguments"]) for call in calls]


def responses_body(extra: dict[str, Any]) -> dict[str, Any]:
    return {"input": QUESTION[0]["content"], "tools": RESPONSES_TOOLS, "stream": True,
            "max_output_tokens": ANSWER, "temperature": 0, **extra}  # fmt: skip


def test_responses_function_calls_go_out_whole_and_well_formed(tapped_pair: Start) -> None:
    """No handoff: llama-server adds every call's item before it closes any; each reaches
    the client whole (its item added, its argument deltas, its item closed)."""
    first, _, proxy, _ = tapped_pair(FUNCTIONARY, "primary")
    body = responses_body(REQUIRED)
    alone = Response(first.url, body, lambda n: None)
    assert len(alone.calls()) > 1
    through = Response(proxy.url, body, lambda n: None)
    assert through.calls() == alone.calls() and not through.notes


def test_a_responses_call_after_the_cut_comes_whole_after_the_message(tapped_pair: Start) -> None:
    """Cut in the words before the call, the same model behind the cut: the client's
    message item is closed once, with the whole text, and the call comes whole."""
    first, _, proxy, _ = tapped_pair(LLAMA31, "primary")
    body = responses_body(WORDS_THEN_CALL)
    alone = Response(first.url, body, lambda n: None)
    assert alone.text and alone.calls()

    def on_text(n: int) -> None:
        if n == CUT - 1:
            os.kill(first.pid, signal.SIGSTOP)
            try:
                assert handoff(proxy, reason="test pressure") == 1
            finally:
                os.kill(first.pid, signal.SIGCONT)

    through = Response(proxy.url, body, on_text)
    (note,) = through.notes
    cut = int(note.split(" after ")[1].split()[0])
    assert 0 < cut < len(alone.text.split()) and "replayed as text" in note, note
    assert through.text == alone.text
    assert through.calls() == alone.calls()
    (message,) = [e["item"] for e in through.events if e["type"] == "response.output_item.done"
                  and e["item"]["type"] == "message"]  # fmt: skip
    assert message["content"][0]["text"] == alone.text
