"""Anthropic Messages and OpenAI Responses answers are continued only where the next
llama-server reads exactly what the model saw and wrote, checked right before each
continuation is sent (handoff/translated.py), as chat answers are.

Real llama-servers, one of them serving Qwen3's real chat template (llama.cpp's own,
`--jinja --chat-template-file`), whose trailing assistant message opens an empty
reasoning block the model never wrote (`<think>\\n\\n</think>`): the start-up proof finds
that its trailing message is not rendered as the model saw it. Put first on the ladder,
it is passed by before the cut, with that reason, and the next server, whose template renders it as
the model saw it, goes on exactly as its own continuation computed directly; alone, the
answer ends with the dialect's own in-band error saying where the prompts part. Before
the check, Qwen3's server took both answers and went on from a prompt the model never
saw."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import httpx
import pytest

from scripts.testbed.llamacppfiles import templates
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.mitm import Mitmdump
from scripts.testbed.prompts import PROMPT
from tests.test_other_apis import (
    LONG,
    NO_CACHE,
    asked_after,
    assert_exact,
    assert_one_message,
    assert_one_response,
    last_handoff,
    messages_stream,
    responses_stream,
)

QWEN3 = "Qwen-Qwen3-0.6B"
PARTED = "<think>\\n\\n</think>"  # how the prompts part, as the error quotes it (repr)


def qwen3_args() -> list[str]:
    (template,) = [t for t in templates() if t.stem == QWEN3]
    return [*NO_CACHE, "--jinja", "--chat-template-file", str(template)]


@pytest.fixture(scope="module")
def ladder(start_server_module, start_proxy_module) -> tuple[LlamaServer, ...]:
    """A primary, Qwen3's server first among its fallbacks, then a plain one."""
    primary = start_server_module("primary", extra_args=NO_CACHE)
    qwen3 = start_server_module("fallback", extra_args=qwen3_args())
    plain = start_server_module("fallback", extra_args=NO_CACHE)
    return primary, qwen3, plain


@pytest.fixture(scope="module", autouse=True)
def warm_clients(ladder) -> None:
    """Each SDK builds its event types on first use, while a tiny model writes hundreds
    of tokens (as in test_other_apis)."""
    messages_stream(ladder[0].url, 4)
    responses_stream(ladder[0].url, 4)


@pytest.fixture(scope="module")
def proxy(start_proxy_module, ladder) -> Mitmdump:
    primary, qwen3, plain = ladder
    mitm = start_proxy_module(primary.url, [qwen3.url, plain.url])
    mitm.servers_known()
    return mitm


def test_qwen3s_trailing_message_is_found_otherwise_at_start_up(proxy, ladder) -> None:
    _, qwen3, plain = ladder
    servers = httpx.get(f"{proxy.url}/spillover/status").json()["servers"]
    assert "<think>" in servers[qwen3.url]["continues_why"], servers[qwen3.url]
    assert "renders what the model saw" in servers[plain.url]["continues_why"]


def assert_passed_by(proxy: Mitmdump, ladder: tuple[LlamaServer, ...]) -> None:
    """The one cut went to the plain server: Qwen3's, first below, was asked and passed
    by before it (answer/decide.py), and the handoff says why."""
    primary, qwen3, plain = ladder
    handoff = httpx.get(f"{proxy.url}/spillover/status").json()["recent_handoffs"][-1]
    assert (handoff["source"], handoff["target"]) == (primary.url, plain.url), handoff
    assert handoff["replay"] == "text" and handoff["kind"] == "requested", handoff
    passed = handoff["passed_by"]
    assert passed.startswith(f"{qwen3.url}: at character"), passed
    assert PARTED in passed and "the model saw" in passed


def test_a_messages_answer_passes_qwen3_by_and_goes_on_exactly(proxy, ladder) -> None:
    primary, _, plain = ladder
    events, text = messages_stream(proxy.url, LONG, asked_after(proxy, primary, 12))
    assert_one_message(events, text, LONG)
    assert_exact(text, last_handoff(proxy), primary.url, plain.url, LONG)
    assert_passed_by(proxy, ladder)


def test_a_responses_answer_passes_qwen3_by_and_goes_on_exactly(proxy, ladder) -> None:
    primary, _, plain = ladder
    events, text = responses_stream(proxy.url, LONG, asked_after(proxy, primary, 12))
    assert_one_response(events, text, LONG)
    assert_exact(text, last_handoff(proxy), primary.url, plain.url, LONG)
    assert_passed_by(proxy, ladder)


MESSAGES = {"model": "tiny", "max_tokens": LONG, "messages": PROMPT, "stream": True,
            "temperature": 0}  # fmt: skip
RESPONSES = {"model": "tiny", "input": PROMPT[0]["content"], "max_output_tokens": LONG,
             "stream": True, "temperature": 0}  # fmt: skip
TEXT_DELTAS = ('"text_delta"', '"response.output_text.delta"')


def killed_after(url: str, path: str, body: dict[str, Any], primary: LlamaServer) -> list[dict]:
    """The events of a stream whose primary is killed after its 12th text delta."""
    events, deltas = [], 0
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if any(kind in line for kind in TEXT_DELTAS) and (deltas := deltas + 1) == 12:
                    os.kill(primary.pid, signal.SIGKILL)
    return events


@pytest.mark.parametrize(
    "path, body, error",
    [
        ("/v1/messages", MESSAGES, lambda e: (e.get("error") or {}).get("message")),
        ("/v1/responses", RESPONSES, lambda e: e.get("message")),
    ],
    ids=["messages", "responses"],
)
def test_an_answer_only_qwen3_could_take_ends_in_band_saying_why(
    start_server, start_proxy, ladder, path, body, error
) -> None:
    _, qwen3, _ = ladder
    primary = start_server("primary", extra_args=NO_CACHE)
    proxy = start_proxy(primary.url, [qwen3.url])
    proxy.servers_known()
    events = killed_after(proxy.url, path, body, primary)
    assert events[-1]["type"] == "error", events[-3:]
    said = error(events[-1])
    assert qwen3.url in said and PARTED in said and "the model saw" in said, said
    assert not any(e.get("type") == "error" for e in events[:-1])
