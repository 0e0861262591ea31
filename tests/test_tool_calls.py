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
JSON the model wrote (the same through the Responses and Messages APIs:
tests/test_tool_calls_apis.py).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest

from scripts.testbed.llamacppfiles import templates
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.mitm import Mitmdump
from tests.streams import RawStream, assert_one_clean_stream, read_stream
from tests.tap import Tap, tapped
from tests.test_raw_output import SAME_BATCHES, pieces, read_cut, text_of, truth
from tests.test_splice import handoff

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
# Llama 3.1's template prints today's date into the prompt, and what the model writes
# depends on it (on 6 Dec 2026, no words before the call): the date is the request's own.
WORDS_THEN_CALL = {
    **REQUIRED, "logit_bias": [["{", 15]],
    "chat_template_kwargs": {"date_string": "05 Dec 2026"},  # words, then a call
}  # fmt: skip
ANSWER = 100
CUT = 8  # chunks: the role, then 7 words


def body_of(extra: dict[str, Any]) -> dict[str, Any]:
    return {"messages": QUESTION, "tools": TOOLS, "max_tokens": ANSWER, "stream": True,
            "temperature": 0, **extra}  # fmt: skip


Start = Callable[[str, str], tuple[LlamaServer, LlamaServer, Mitmdump, Tap]]


@contextmanager
def tapped_pairs(
    start_server: Callable[..., LlamaServer], start_proxy: Callable[..., Mitmdump]
) -> Iterator[Start]:
    """Starts (primary, fallback, proxy, tap): the proxy reaches the primary through the
    tap."""
    by_name = {template.stem: template for template in templates()}
    with ExitStack() as taps:

        def start(template: str, fallback: str) -> tuple[LlamaServer, LlamaServer, Mitmdump, Tap]:
            args = ["--jinja", "--chat-template-file", str(by_name[template]), *SAME_BATCHES]
            first = start_server("primary", extra_args=args)
            second = start_server(fallback, extra_args=args)
            tap = taps.enter_context(tapped(first.port))
            proxy = start_proxy(tap.url, [second.url])
            proxy.servers_known()
            return first, second, proxy, tap

        yield start


@pytest.fixture
def tapped_pair(
    start_server: Callable[..., LlamaServer], start_proxy: Callable[..., Mitmdump]
) -> Iterator[Start]:
    with tapped_pairs(start_server, start_proxy) as start:
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
    stream = read_cut(proxy, body, [first], (CUT,))
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
    stream = read_cut(proxy, body, [first], (CUT,))
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
    tap.arm(lambda seen: seen.count(b'"arguments"') >= 3, first.kill, dies=True)
    stream = read_stream(proxy.url, body)
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    # At least the words before the call were written (a word may be more than one token,
    # and what the model writes depends on the date its template prints).
    cut = int(note.split(" after ")[1].split()[0])
    assert cut >= len(alone.segments[0].split()) and "replayed as text" in note, note
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
    dies = cut == "failure"
    tap.arm(lambda seen: b'"index":1' in seen, first.kill if dies else stopped, dies=dies)

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
    tap.arm(lambda seen: seen.count(b'"arguments"') >= 3, first.kill, dies=True)
    stream = read_stream(proxy.url, body)
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert "replayed" not in note, note
    spent = int(note.split(" after ")[1].split()[0])
    alone = read_stream(second.url, {**body, "max_tokens": ANSWER - spent})
    assert calls_of(stream) == calls_of(alone) and stream.text == alone.text
    no_markup(stream)
