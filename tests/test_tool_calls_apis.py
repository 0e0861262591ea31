"""Tool calls through the APIs whose events name their type, on real llama-servers
with llama.cpp's real chat templates behind a real proxy (issue 50; the chat cases and
how real calls are made are in tests/test_tool_calls.py).

A call is an item of its own there (a Responses `function_call` item, a Messages
`tool_use` block), and llama-server interleaves its events with the others': it opens a
call while the message item is still open, and opens every call of an answer before it
closes any. Each call must reach the client whole and well formed (opened once, its
argument deltas, closed once, those deltas put together its arguments as JSON), with no
handoff and across one; the message item is closed once.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.mitm import Mitmdump
from tests.test_splice import handoff
from tests.test_tool_calls import (
    ANSWER,
    CUT,
    FUNCTIONARY,
    LLAMA31,
    QUESTION,
    REQUIRED,
    TOOLS,
    WORDS_THEN_CALL,
    Start,
    tapped_pairs,
)


@pytest.fixture
def tapped_pair(
    start_server: Callable[..., LlamaServer], start_proxy: Callable[..., Mitmdump]
) -> Iterator[Start]:
    with tapped_pairs(start_server, start_proxy) as start:
        yield start


RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]


class Response:
    """A Responses stream as the client read it: its events, notes and errors."""

    def __init__(self, url: str, body: dict[str, Any], on_text: Callable[[int], None]) -> None:
        self.events: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.text_at_notes: list[int] = []  # how much text the client had at each note
        texts = 0
        with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=60) as reply:
            for line in reply.iter_lines():
                if line.startswith(":"):
                    self.notes.append(line)
                    self.text_at_notes.append(len(self.text))
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
    # The primary's own words up to the cut; after it, the same model's continuation of
    # them as text (which can part from the primary's where a word re-reads as other
    # tokens: what the model writes depends on the date its template prints).
    (before,) = through.text_at_notes
    assert before and alone.text.startswith(through.text[:before])
    assert [name for name, _ in through.calls()] == [name for name, _ in alone.calls()]
    (message,) = [e["item"] for e in through.events if e["type"] == "response.output_item.done"
                  and e["item"]["type"] == "message"]  # fmt: skip
    assert message["content"][0]["text"] == through.text


MESSAGES_TOOLS = [{"name": "get_weather", "description": TOOLS[0]["function"]["description"],
                   "input_schema": TOOLS[0]["function"]["parameters"]}]  # fmt: skip
ANY = {"tool_choice": {"type": "any"}}  # (llama-server's Messages route drops logit_bias)


def tool_uses(url: str, body: dict[str, Any]) -> tuple[list[tuple[str, str]], list[str]]:
    """The tool_use blocks of a Messages stream, (name, input) in the order they closed,
    each checked well formed (started once, its input deltas, stopped once, the deltas
    put together JSON), and its notes."""
    blocks: dict[int, dict[str, Any]] = {}
    stopped: list[int] = []
    notes: list[str] = []
    with httpx.stream("POST", f"{url}/v1/messages", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith(":"):
                notes.append(line)
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            kind, index = event["type"], event.get("index")
            if kind == "content_block_start":
                assert index not in blocks, f"block {index} started twice"
                blocks[index] = {**event["content_block"], "input": ""}
            elif kind == "content_block_delta":
                assert index in blocks and index not in stopped, event
                blocks[index]["input"] += event["delta"].get("partial_json", "")
            elif kind == "content_block_stop":
                assert index in blocks and index not in stopped, f"block {index} stopped"
                stopped.append(index)
    assert sorted(stopped) == sorted(blocks) == list(range(len(blocks))), "every block"
    tools = [blocks[i] for i in stopped if blocks[i]["type"] == "tool_use"]
    for tool in tools:
        json.loads(tool["input"])
    return [(tool["name"], tool["input"]) for tool in tools], notes


def messages_body(extra: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", "messages": QUESTION, "tools": MESSAGES_TOOLS, "stream": True,
            "max_tokens": ANSWER, "temperature": 0, **extra}  # fmt: skip


def test_messages_tool_use_blocks_go_out_whole_and_well_formed(tapped_pair: Start) -> None:
    """No handoff: llama-server starts every tool_use block before it stops any."""
    first, _, proxy, _ = tapped_pair(FUNCTIONARY, "primary")
    body = messages_body(ANY)
    alone, _ = tool_uses(first.url, body)
    assert len(alone) > 1
    through, notes = tool_uses(proxy.url, body)
    assert through == alone and not notes


def test_a_first_tool_use_cut_starts_over_whole_on_the_fallback(tapped_pair: Start) -> None:
    """The primary dies inside its first tool_use block: nothing of it was sent, and the
    fallback (another model) writes its own blocks whole."""
    first, second, proxy, tap = tapped_pair(FUNCTIONARY, "fallback")
    body = messages_body(ANY)
    tap.arm(lambda seen: seen.count(b"input_json_delta") >= 3, first.kill, dies=True)
    through, notes = tool_uses(proxy.url, body)
    (note,) = notes
    spent = int(note.split(" after ")[1].split()[0])
    alone, _ = tool_uses(second.url, {**body, "max_tokens": ANSWER - spent})
    assert through == alone
