"""Before the first byte, as the common gateways behave: a busy server's refusal (408,
429, 503, with or without Retry-After) sends the request to the next server and keeps new
requests away from it for the header's time; a prompt too long for a server's context
goes to one with more room; a short Retry-After from the primary (within
spillover_busy_wait_s) is waited out there first, exactly as long as it asks; with
nowhere else to go, a short one is waited out too, and otherwise the client gets the
server's own refusal, as it sent it. The busy servers
are scripted stand-ins (no real engine refuses on demand); the context refusals are
llama-server's own (vLLM's: tests/test_vllm.py)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.prompts import PROMPT, chat_body
from scripts.testbed.scripted_upstream import STREAM_HEAD, FakeUpstream, chunked, sse_chunk
from tests.streams import assert_one_clean_stream, direct_text, read_stream

REASONS = {
    408: b"Request Timeout", 429: b"Too Many Requests", 500: b"Internal Server Error",
    503: b"Service Unavailable",
}  # fmt: skip
SAID = {"error": {"code": 429, "message": "slow down", "type": "rate_limit_error"}}


def refusal(status: int, retry_after: int | None = None) -> bytes:
    body = json.dumps({**SAID, "error": {**SAID["error"], "code": status}}).encode()
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n" % (status, REASONS[status])
    if retry_after is not None:
        head += b"retry-after: %d\r\n" % retry_after
    return head + b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)


def metrics(proxy) -> str:
    return httpx.get(f"{proxy.url}/spillover/metrics").text


@pytest.mark.parametrize(("status", "retry_after"), [(429, 30), (408, None), (503, 30)])
def test_a_busy_server_sends_the_request_on_and_new_ones_start_elsewhere(
    status: int, retry_after: int | None, start_proxy, fallback: LlamaServer
) -> None:
    busy = FakeUpstream([(refusal(status, retry_after), 0)])
    proxy = start_proxy(busy.url, [fallback.url])
    proxy.servers_known()
    stream = read_stream(proxy.url, chat_body(40))
    assert_one_clean_stream(stream)
    assert f"HTTP {status} from {busy.url}: busy for" in stream.notes[0]
    assert stream.text == direct_text(fallback.url, 40)
    state = httpx.get(f"{proxy.url}/spillover/status").json()["routing"]["states"][busy.url]
    assert state == {"state": "busy", "why": f"HTTP {status}"}
    again = read_stream(proxy.url, chat_body(40))
    assert_one_clean_stream(again)
    assert f"{busy.url} is busy (HTTP {status})" in again.notes[0]
    assert len(busy.requests) == 1  # the second request never went to the busy server
    assert 'spillover_refusals_total{kind="busy"} 1.0' in metrics(proxy)
    busy.close()


RIVER = chunked(
    sse_chunk(role=True), sse_chunk(" the"), sse_chunk(" river"), sse_chunk(finish="length"),
    b"data: [DONE]\n\n",
)  # fmt: skip


def test_with_nowhere_else_a_short_retry_after_is_waited_out(start_proxy) -> None:
    busy = FakeUpstream([(refusal(429, 1), 0)], later=[(STREAM_HEAD + RIVER + b"0\r\n\r\n", 0)])
    proxy = start_proxy(busy.url, [])
    proxy.servers_known()
    started = time.monotonic()
    stream = read_stream(proxy.url, chat_body(2))
    waited = time.monotonic() - started
    assert_one_clean_stream(stream)
    assert stream.text == " the river" and stream.notes == []  # as if it never refused
    assert len(busy.requests) == 2 and waited >= 1.0
    assert 'spillover_refusals_total{kind="waited"} 1.0' in metrics(proxy)
    busy.close()


@pytest.mark.parametrize("wait_s", [0, 2])
def test_a_short_retry_after_from_the_primary_is_waited_out_there_before_the_fallback(
    wait_s: int, start_proxy, fallback: LlamaServer
) -> None:
    """The primary is the model the client came for: a 429 asking for 1 s is waited out
    (no longer than it asks) and the answer is the primary's, the fallback never asked.
    With spillover_busy_wait_s=0 the request goes to the fallback at once."""
    busy = FakeUpstream([(refusal(429, 1), 0)], later=[(STREAM_HEAD + RIVER + b"0\r\n\r\n", 0)])
    proxy = start_proxy(busy.url, [fallback.url], options=[f"spillover_busy_wait_s={wait_s}"])
    proxy.servers_known()
    started = time.monotonic()
    stream = read_stream(proxy.url, chat_body(2))
    waited = time.monotonic() - started
    assert_one_clean_stream(stream)
    if wait_s:
        assert stream.text == " the river" and stream.notes == []  # as if it never refused
        assert len(busy.requests) == 2 and 1.0 <= waited < 1.9
        assert 'spillover_refusals_total{kind="waited"} 1.0' in metrics(proxy)
    else:
        assert stream.text == direct_text(fallback.url, 2)
        assert "HTTP 429 from" in stream.notes[0] and len(busy.requests) == 1
        assert waited < 1.0
    busy.close()


def test_with_nowhere_else_the_client_gets_the_servers_own_refusal(start_proxy) -> None:
    """A long Retry-After is the client's to wait out (its SDK does): passed on as sent."""
    busy = FakeUpstream([(refusal(429, 60), 0)])
    proxy = start_proxy(busy.url, [])
    proxy.servers_known()
    reply = httpx.post(f"{proxy.url}/v1/chat/completions", json=chat_body(20))
    assert reply.status_code == 429 and reply.headers["retry-after"] == "60"
    assert reply.json() == {**SAID, "error": {**SAID["error"], "code": 429}}
    assert len(busy.requests) == 1  # no loop against a server that is refusing
    busy.close()


LONG_QUESTION = [{"role": "user", "content": " ".join(["the river and the bridge"] * 80)}]


def test_a_prompt_too_long_for_the_primary_goes_to_a_server_with_more_room(
    start_server, start_proxy
) -> None:
    primary = start_server("primary", ctx_size=256, slots=1)
    roomy = start_server("fallback", ctx_size=4096, slots=1)
    small = start_server("fallback", ctx_size=128, slots=1)
    body = chat_body(20, messages=LONG_QUESTION)
    # llama-server's own refusal, asked directly: what the addon must recognise.
    direct = httpx.post(f"{primary.url}/v1/chat/completions", json={**body, "stream": False})
    assert direct.status_code == 400 and "exceed_context_size_error" in direct.text

    proxy = start_proxy(primary.url, [small.url, roomy.url])
    proxy.servers_known()
    stream = read_stream(proxy.url, body)
    assert_one_clean_stream(stream)
    assert f"HTTP 400 from {primary.url}: the prompt does not fit its context" in stream.notes[0]
    assert f"-> {roomy.url}" in stream.notes[0]  # the smaller one was passed over
    assert stream.text == direct_text(roomy.url, 20, messages=LONG_QUESTION)

    only_smaller = start_proxy(primary.url, [small.url])
    only_smaller.servers_known()
    reply = httpx.post(f"{only_smaller.url}/v1/chat/completions", json={**body, "stream": False})
    assert reply.status_code == 400 and reply.json() == direct.json()  # its own error


def test_an_ordinary_bad_request_is_the_clients_answer(
    start_proxy, primary: LlamaServer, fallback: LlamaServer
) -> None:
    proxy = start_proxy(primary.url, [fallback.url])
    proxy.servers_known()
    bad = {"messages": PROMPT, "max_tokens": "many"}
    direct = httpx.post(f"{primary.url}/v1/chat/completions", json=bad)
    through = httpx.post(f"{proxy.url}/v1/chat/completions", json=bad)
    assert direct.status_code == through.status_code and 400 <= direct.status_code < 500
    assert through.json() == direct.json()
    assert "spillover_refusals_total{" not in metrics(proxy)  # nothing was sent on


@pytest.mark.parametrize("ask_again", [True, False])
def test_a_primarys_server_error_is_asked_again_there_once(
    ask_again: bool, start_proxy, fallback: LlamaServer
) -> None:
    """Stand-in primary (no real engine fails with a 500 on demand): its first answer is
    a 500, the next a whole answer, and its /health says ok. By default it is asked once
    more, and the answer comes from it; with spillover_retry_5xx=false, from the fallback."""
    answer = chunked(
        sse_chunk(role=True), sse_chunk(" the"), sse_chunk(" river"), sse_chunk(finish="length"),
        b"data: [DONE]\n\n",
    )  # fmt: skip
    failing = FakeUpstream([(refusal(500), 0)], later=[(STREAM_HEAD + answer + b"0\r\n\r\n", 0)])
    options = [] if ask_again else ["spillover_retry_5xx=false"]
    proxy = start_proxy(failing.url, [fallback.url], options=options)
    proxy.servers_known()
    stream = read_stream(proxy.url, chat_body(40))
    assert_one_clean_stream(stream)
    if ask_again:
        assert stream.text == " the river" and stream.notes == []
        assert len(failing.requests) == 2
        assert 'spillover_refusals_total{kind="asked_again"} 1.0' in metrics(proxy)
    else:
        assert f"HTTP 500 from {failing.url}" in stream.notes[0]
        assert stream.text == direct_text(fallback.url, 40)
        assert len(failing.requests) == 1
    failing.close()


def test_a_primary_that_fails_again_is_left_for_the_fallback(
    start_proxy, fallback: LlamaServer
) -> None:
    """Stand-in primary that answers every request with a 500: asked twice, no more."""
    failing = FakeUpstream([(refusal(500), 0)])
    proxy = start_proxy(failing.url, [fallback.url])
    proxy.servers_known()
    stream = read_stream(proxy.url, chat_body(40))
    assert_one_clean_stream(stream)
    assert stream.text == direct_text(fallback.url, 40)
    assert len(failing.requests) == 2
    failing.close()
