"""Ollama chat streams (/api/chat) carried across handoffs, read by the official `ollama`
client through a real mitmdump with the addon.

Ollama cannot run here, so both servers are scripted (scripts/testbed/ollama_upstream.py): each
speaks Ollama's NDJSON wire format and writes a deterministic answer that depends on
the text before it, so the text across a cut can be checked exactly."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import ollama

from scripts.testbed.memfiles import FakeCard
from scripts.testbed.mitm import Mitmdump, watch_sysfs
from scripts.testbed.ollama_upstream import OllamaUpstream, answer, generated
from tests.test_splice import handoff

MESSAGES = [{"role": "user", "content": "Tell me a story about the river and the bridge."}]
TOKENS = 40


def chat(proxy: Mitmdump, on_piece=None) -> tuple[str, Any, int]:
    """The text of one streamed answer, its last chunk, and how many chunks came."""
    client = ollama.Client(host=proxy.url)
    pieces, last = [], None
    for chunk in client.chat(
        model="m", messages=MESSAGES, stream=True, options={"num_predict": TOKENS}
    ):
        pieces.append(chunk.message.content)
        last = chunk
        if on_piece is not None:
            on_piece(len(pieces))
    return "".join(pieces), last, len(pieces)


def expected(cut: int) -> str:
    """The primary's first `cut` words, then the fallback's own continuation of them."""
    before = "".join(answer("primary", MESSAGES, cut))
    prefill = [*MESSAGES, {"role": "assistant", "content": before}]
    return before + "".join(answer("fallback", prefill, TOKENS - cut))


def assert_whole(last: Any, chunks: int) -> None:
    assert last.done and last.done_reason == "length"
    assert last.eval_count == TOKENS  # counted over both servers
    assert chunks == TOKENS + 1  # one chunk a word, then the last


def last_handoff(proxy: Mitmdump) -> dict[str, Any]:
    return httpx.get(f"{proxy.url}/spillover/status").json()["recent_handoffs"][-1]


def test_an_ollama_stream_without_handoff_is_the_servers_own(start_proxy) -> None:
    primary = OllamaUpstream("primary")
    proxy = start_proxy(primary.url, [])
    body = {"model": "m", "messages": MESSAGES, "options": {"num_predict": 8}}

    def raw(url: str) -> tuple[int, dict, str]:
        reply = httpx.post(f"{url}/api/chat", json=body)
        headers = {k: v for k, v in reply.headers.items() if k not in ("date", "server")}
        return reply.status_code, headers, re.sub(r'"created_at":"[^"]+"', "", reply.text)

    assert raw(proxy.url) == raw(primary.url)
    primary.close()


def test_a_primary_that_dies_mid_answer_is_continued(start_proxy) -> None:
    primary, fallback = OllamaUpstream("primary", cut_after=15), OllamaUpstream("fallback")
    proxy = start_proxy(primary.url, [fallback.url])
    text, last, chunks = chat(proxy)
    assert text == expected(15)
    assert_whole(last, chunks)
    cut = last_handoff(proxy)
    assert cut["kind"] == "failure" and cut["at_token"] == 15
    (continued,) = fallback.requests
    assert continued["messages"][-1]["role"] == "assistant"
    assert continued["options"]["num_predict"] == TOKENS - 15
    primary.close()
    fallback.close()


def test_an_error_line_from_the_primary_hands_off(start_proxy) -> None:
    primary, fallback = OllamaUpstream("primary", error_after=9), OllamaUpstream("fallback")
    proxy = start_proxy(primary.url, [fallback.url])
    text, last, chunks = chat(proxy)
    assert text == expected(9)
    assert_whole(last, chunks)
    assert "model runner has unexpectedly stopped" in last_handoff(proxy)["reason"]
    primary.close()
    fallback.close()


def test_a_requested_handoff_is_continued(start_proxy) -> None:
    primary = OllamaUpstream("primary", pause_s=0.02)
    fallback = OllamaUpstream("fallback")
    proxy = start_proxy(primary.url, [fallback.url])
    text, last, chunks = chat(proxy, lambda n: n == 10 and handoff(proxy, reason="test"))
    cut = last_handoff(proxy)
    assert cut["kind"] == "requested" and cut["at_token"] >= 10
    assert text == expected(cut["at_token"])
    assert_whole(last, chunks)
    primary.close()
    fallback.close()


def test_pressure_hands_off_an_ollama_stream(start_proxy, tmp_path: Path) -> None:
    primary = OllamaUpstream("primary", pause_s=0.02)
    fallback = OllamaUpstream("fallback")
    sysfs = tmp_path / "sys"
    card0 = FakeCard(sysfs, "card0", total_mib=16384, used_mib=10000)
    FakeCard(sysfs, "card1", total_mib=8192, used_mib=2000)
    on = {primary.url: "drm:card0", fallback.url: "drm:card1"}
    proxy = start_proxy(primary.url, [fallback.url], options=watch_sysfs(sysfs, on))
    text, last, chunks = chat(proxy, lambda n: n == 10 and card0.set_used(15041))
    cut = last_handoff(proxy)
    assert cut["kind"] == "pressure"
    assert text == expected(cut["at_token"])
    assert_whole(last, chunks)
    primary.close()
    fallback.close()


def test_no_server_left_ends_with_an_error_line_the_client_reads(start_proxy) -> None:
    primary = OllamaUpstream("primary", cut_after=5)
    proxy = start_proxy(primary.url, [])
    with httpx.stream("POST", f"{proxy.url}/api/chat", json={"messages": MESSAGES}) as reply:
        lines = [json.loads(line) for line in reply.iter_lines() if line]
    assert [line["message"]["content"] for line in lines[:-1]] == answer("primary", MESSAGES, 48)[
        :5
    ]
    assert "no server could continue this answer" in lines[-1]["error"]
    primary.close()


PROMPT_TEXT = MESSAGES[0]["content"]


def generate(proxy: Mitmdump, **extra: Any) -> tuple[str, Any, int]:
    client = ollama.Client(host=proxy.url)
    pieces, last = [], None
    for chunk in client.generate(
        model="m", prompt=PROMPT_TEXT, stream=True, options={"num_predict": TOKENS}, **extra
    ):
        pieces.append(chunk.response)
        last = chunk
    return "".join(pieces), last, len(pieces)


def test_a_generate_stream_is_continued_as_the_chat_ollama_renders_it(start_proxy) -> None:
    primary, fallback = OllamaUpstream("primary", cut_after=12), OllamaUpstream("fallback")
    proxy = start_proxy(primary.url, [fallback.url])
    text, last, chunks = generate(proxy, system="Be brief.")
    asked = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT_TEXT}]
    before = "".join(answer("primary", asked, 12))
    after = answer("fallback", [*asked, {"role": "assistant", "content": before}], TOKENS - 12)
    assert text == before + "".join(after)
    assert_whole(last, chunks)
    assert last.context is None  # another server's tokens would make it wrong
    (continued,) = fallback.requests
    assert continued["messages"] == [*asked, {"role": "assistant", "content": before}]
    assert "prompt" not in continued and "system" not in continued
    primary.close()
    fallback.close()


def test_a_raw_generate_stream_goes_on_from_its_own_prompt(start_proxy) -> None:
    primary, fallback = OllamaUpstream("primary", error_after=7), OllamaUpstream("fallback")
    proxy = start_proxy(primary.url, [fallback.url])
    text, last, chunks = generate(proxy, raw=True)
    before = "".join(generated("primary", {"raw": True, "prompt": PROMPT_TEXT}, 7))
    rest = generated("fallback", {"raw": True, "prompt": PROMPT_TEXT + before}, TOKENS - 7)
    assert text == before + "".join(rest)
    assert_whole(last, chunks)
    (continued,) = fallback.requests
    assert continued["prompt"] == PROMPT_TEXT + before and continued["raw"] is True
    primary.close()
    fallback.close()


def test_a_generate_stream_without_handoff_keeps_its_context(start_proxy) -> None:
    primary = OllamaUpstream("primary")
    proxy = start_proxy(primary.url, [])
    text, last, _ = generate(proxy)
    assert text == "".join(generated("primary", {"prompt": PROMPT_TEXT}, TOKENS))
    assert last.context and len(last.context) == TOKENS
    primary.close()
