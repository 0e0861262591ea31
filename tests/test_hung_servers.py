"""Hung and slow servers are left: a leg that stops sending (SIGSTOP) is dropped like a
failed one, and one that slows far below its own pace (a SIGSTOP/SIGCONT duty cycle, as
when a card's memory spills into system RAM) moves on like an asked-for handoff."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx

from scripts.testbed.scripted_upstream import STREAM_HEAD, FakeUpstream, chunked, sse_chunk
from tests.streams import RawStream, assert_one_clean_stream, chat_body, direct_text, read_stream
from tests.throttle import Throttled

QUICK = ["spillover_stall_s=1", "spillover_first_token_s=2"]


def _stop(server) -> None:
    os.kill(server.pid, signal.SIGSTOP)


def _resume(server) -> None:
    os.kill(server.pid, signal.SIGCONT)


def assert_left_once(stream: RawStream, tokens: int, *said: str) -> None:
    """One clean answer of `tokens` tokens, moved once, with a note that says `said`."""
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert all(words in note for words in said), note
    assert sum(stream.segment_tokens) == tokens


def assert_left_after(proxy, fallback, wait_s: int) -> None:
    """A new answer, whose primary says nothing, is left for the fallback after `wait_s`
    (not sooner, nor near the 300 s ceiling), whole, with a note that says so."""
    started = time.monotonic()
    stream = read_stream(proxy.url, chat_body(40))
    waited = time.monotonic() - started
    assert_one_clean_stream(stream)
    assert stream.text == direct_text(fallback.url, 40)
    assert wait_s <= waited < 30, waited
    said = (f"no answer after {wait_s}.", f"(waited {wait_s} s)")
    assert any(all(words in note for words in said) for note in stream.notes), stream.notes


def assert_counted(proxy, kind: str) -> None:
    metrics = httpx.get(f"{proxy.url}/spillover/metrics").text
    assert f'spillover_handoffs_total{{kind="{kind}"}} 1.0' in metrics


def test_a_stalled_primary_is_left_for_the_fallback(start_server, start_proxy, fallback) -> None:
    primary = start_server("primary")
    proxy = start_proxy(primary.url, [fallback.url], options=QUICK)
    try:
        stream = read_stream(
            proxy.url, chat_body(600), on_chunk=lambda n: n == 50 and _stop(primary)
        )
    finally:
        _resume(primary)
    assert_left_once(stream, 600, f"{primary.url} -> {fallback.url}", "nothing for 1.")
    assert_counted(proxy, "stalled")


def test_a_primary_that_never_answers_is_left_before_its_first_token(
    start_server, start_proxy, fallback
) -> None:
    primary = start_server("primary")
    proxy = start_proxy(primary.url, [fallback.url], options=QUICK)
    _stop(primary)
    try:
        started = time.monotonic()
        stream = read_stream(proxy.url, chat_body(50))
        waited = time.monotonic() - started
    finally:
        _resume(primary)
    assert_one_clean_stream(stream)
    assert "no answer after 2." in stream.notes[0] and stream.segments[0] == ""
    assert 2 <= waited < 10


def test_a_stall_with_nowhere_to_go_ends_with_an_error(start_server, start_proxy) -> None:
    primary = start_server("primary")
    proxy = start_proxy(primary.url, [], options=QUICK)
    try:
        stream = read_stream(
            proxy.url, chat_body(600), on_chunk=lambda n: n == 50 and _stop(primary)
        )
    finally:
        _resume(primary)
    assert stream.status == 200 and stream.done == 0
    assert stream.segment_tokens[0] >= 49  # what was delivered stays delivered
    (error,) = stream.errors
    assert "no server could continue this answer" in error["error"]["message"]
    assert "nothing for 1." in error["error"]["message"]


def test_a_slowed_primary_is_left_for_the_fallback(start_server, start_proxy) -> None:
    """The primary runs at full speed for a whole pace window, then 20 times slower. The
    slowdown starts on a timer, not on what the client has read (a loaded machine's
    client lags, and the primary had written the whole answer by the client's 60th
    chunk), and the answer is sized by the primary's own speed, measured first, so it
    is still being written then on a fast machine or a slow one."""
    primary = start_server("primary", ctx_size=16384, slots=1)
    fallback = start_server("fallback", ctx_size=16384, slots=1)
    started = time.monotonic()
    httpx.post(f"{primary.url}/completion", json={"prompt": "x", "n_predict": 400,
               "temperature": 0, "ignore_eos": True}, timeout=60)  # fmt: skip
    per_s = 400 / (time.monotonic() - started)
    fast_s = 1.5  # the window is 1 s
    tokens = min(15000, int(per_s * fast_s) + 1500)
    options = ["spillover_slow_percent=25", "spillover_slow_window_s=1"]
    proxy = start_proxy(primary.url, [fallback.url], options=options)
    slowed = Throttled(primary.pid, run_s=0.01, period_s=0.2)  # about 20 times slower
    slowing = threading.Timer(fast_s, slowed.start)
    try:
        slowing.start()
        stream = read_stream(proxy.url, chat_body(tokens), timeout=60)
    finally:
        slowing.cancel()
        slowing.join()
        slowed.stop()
    moved = f"{primary.url} -> {fallback.url}"
    assert_left_once(stream, tokens, moved, "events/s over 1 s, down from")
    assert_counted(proxy, "slow")


def answer_with_timings(prompt_n: int, prompt_ms: float) -> bytes:
    """A short whole answer whose last chunk times its prompt reading, as llama-server's
    does (`timings`)."""
    last = {
        "id": "c", "created": 1, "model": "stand-in", "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        "timings": {"prompt_n": prompt_n, "prompt_ms": prompt_ms},
    }  # fmt: skip
    events = chunked(
        sse_chunk(role=True), sse_chunk(" the"),
        b"data: " + json.dumps(last).encode() + b"\n\n", b"data: [DONE]\n\n",
    )  # fmt: skip
    return STREAM_HEAD + events + b"0\r\n\r\n"


def test_a_silent_primary_is_left_when_its_prompt_should_have_been_read(
    start_proxy, fallback
) -> None:
    """Stand-in primary (no real server goes silent on its second request only): it
    answers once, saying it read 200 tokens in 20 ms, then accepts requests and says
    nothing. The wait comes from that speed and the prompt's size (a few KB read in well
    under a second, times 4), not from the 300 s ceiling: the floor, 2 s, applies."""
    silent = FakeUpstream(
        [(answer_with_timings(200, 20.0), 0)], later=[(b"HTTP/1.1 200 OK\r\n", 120)]
    )
    proxy = start_proxy(silent.url, [fallback.url], options=["spillover_first_token_floor_s=2"])
    proxy.servers_known()
    assert read_stream(proxy.url, chat_body(5)).text == " the"
    rates = httpx.get(f"{proxy.url}/spillover/status").json()["migration"]["rates"]
    assert rates["read_ms_per_token"] == {silent.url: 0.1}
    assert_left_after(proxy, fallback, 2)
    silent.close()


def test_a_long_prompt_is_given_the_time_its_reading_takes(start_server, start_proxy) -> None:
    """Real llama-server, no floor: the wait is 4 times the prompt's reading at the speed
    measured on a short one. A prompt 120 times longer takes longer to read than a short
    prompt's wait (at 60 times it did not, once, in a loaded run: a short prompt's reading
    is slowed more by its fixed cost), and is read whole, never cut."""
    primary = start_server("primary", ctx_size=16384, slots=1)
    proxy = start_proxy(primary.url, [], options=["spillover_first_token_floor_s=0"])
    short = [{"role": "user", "content": " ".join(["the river and the bridge"] * 10)}]
    long = [{"role": "user", "content": " ".join(["the river and the bridge"] * 1200)}]
    for _ in range(2):  # the speed is learnt from answers through the proxy
        read_stream(proxy.url, {**chat_body(4), "messages": short})
    rates = httpx.get(f"{proxy.url}/spillover/status").json()["migration"]["rates"]
    read_ms = rates["read_ms_per_token"][primary.url]
    short_wait_s = 4 * (len(json.dumps({**chat_body(4), "messages": short})) + 256) * read_ms / 1000
    body = {**chat_body(20), "messages": long}
    direct = httpx.post(
        f"{primary.url}/v1/chat/completions", json={**body, "stream": False}, timeout=120
    ).json()
    assert direct["timings"]["prompt_ms"] / 1000 > short_wait_s, (direct["timings"], read_ms)
    stream = read_stream(proxy.url, body, timeout=120)
    assert_one_clean_stream(stream)
    assert stream.notes == []
    assert stream.text == direct["choices"][0]["message"]["content"]


def test_a_server_never_measured_that_never_answers_is_left_on_time(start_proxy, fallback) -> None:
    """Stand-in primary (no real server accepts and then sends nothing, not even headers,
    on demand): it was never measured, so the wait is spillover_first_token_unmeasured_s
    (3 s here; 60 by default), not the 300 s ceiling. It does not list its slots, so it
    is not reading a prompt: left for the fallback."""
    silent = FakeUpstream([(b"", 120)])
    proxy = start_proxy(
        silent.url, [fallback.url], options=["spillover_first_token_unmeasured_s=3"]
    )
    assert_left_after(proxy, fallback, 3)
    silent.close()


def test_any_engines_first_events_teach_its_wait(start_proxy, fallback) -> None:
    """Stand-in primary (a server that answers once, then goes silent, on demand), which
    gives no timings of its own (as vLLM or a hosted API): how long its first answer took
    to its first event sets the wait, the floor (2 s here) rather than the 60 s a server
    never measured would get."""
    answer = STREAM_HEAD + chunked(
        sse_chunk(role=True), sse_chunk(" the"), sse_chunk(finish="stop"), b"data: [DONE]\n\n"
    ) + b"0\r\n\r\n"  # fmt: skip
    silent = FakeUpstream([(answer, 0)], later=[(b"", 120)])
    proxy = start_proxy(silent.url, [fallback.url], options=["spillover_first_token_floor_s=2"])
    assert read_stream(proxy.url, chat_body(5)).text == " the"
    learnt = httpx.get(f"{proxy.url}/spillover/status").json()["routing"]
    assert set(learnt["first_event_ms_per_byte"]) == {silent.url}
    assert_left_after(proxy, fallback, 2)
    silent.close()


def test_a_llama_server_still_reading_a_long_prompt_is_never_cut(
    start_server, start_proxy, fallback
) -> None:
    """Real llama-server, never measured, slowed about ten times (a big model's prompt on
    a slow card), with a 1 s wait for a server never measured: reading the prompt takes
    longer than that, and each time the wait runs out its /slots says it is still reading,
    so the answer is its own, whole."""
    primary = start_server("primary", ctx_size=16384, slots=1)
    proxy = start_proxy(
        primary.url, [fallback.url], options=["spillover_first_token_unmeasured_s=1"]
    )
    long = [{"role": "user", "content": " ".join(["the river and the bridge"] * 1200)}]
    body = {**chat_body(20), "messages": long, "cache_prompt": False}  # read whole each time
    direct = httpx.post(
        f"{primary.url}/v1/chat/completions", json={**body, "stream": False}, timeout=120
    ).json()
    with Throttled(primary.pid, run_s=0.002, period_s=0.02):
        started = time.monotonic()
        stream = read_stream(proxy.url, body, timeout=300)
        waited = time.monotonic() - started
    assert_one_clean_stream(stream)
    # (llama-server's own keep-alive ping, ":", may come through on a slow stream)
    assert [note for note in stream.notes if note != ":"] == [], stream.notes
    assert stream.text == direct["choices"][0]["message"]["content"]
    assert waited > 1, waited  # it did wait past the unmeasured bound
    assert "is still at work (slot 0 reading " in proxy.log_path.read_text()


def test_a_server_that_hangs_after_the_answers_end_has_its_stream_ended_there(
    start_proxy, fallback
) -> None:
    """A server that sends the finish chunk and then nothing, neither [DONE] nor the end of
    its body, and keeps the connection open (a stand-in: no real server hangs there on
    demand): the answer is whole, so the client gets it and the stream's own end once the
    stall wait is over, from the same server, with no handoff and no error."""
    words = ["One", " two", " three."]
    chunks = [sse_chunk(role=True), *(sse_chunk(w) for w in words), sse_chunk(finish="stop")]
    primary = FakeUpstream([(STREAM_HEAD + chunked(*chunks), 30)])
    proxy = start_proxy(primary.url, [fallback.url], options=QUICK)
    started = time.monotonic()
    with httpx.stream(
        "POST", f"{proxy.url}/v1/chat/completions", json=chat_body(40), timeout=15
    ) as reply:
        received = reply.read()
    waited = time.monotonic() - started
    assert received == b"".join(chunks) + b"data: [DONE]\n\n"
    assert 1 <= waited < 10, waited
    status = httpx.get(f"{proxy.url}/spillover/status").json()
    assert status["recent_handoffs"] == []
    primary.close()
