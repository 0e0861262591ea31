"""Hung and slow servers are left: a leg that stops sending (SIGSTOP) is dropped like a
failed one, and one that slows far below its own pace (a SIGSTOP/SIGCONT duty cycle, as
when a card's memory spills into system RAM) moves on like an asked-for handoff."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx

from tests.streams import RawStream, assert_one_clean_stream, chat_body, read_stream

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
    done = threading.Event()

    def duty_cycle() -> None:
        """Runs the primary 10 ms in every 200: about 20 times slower."""
        while not done.is_set():
            _stop(primary)
            time.sleep(0.19)
            _resume(primary)
            time.sleep(0.01)

    cycler = threading.Timer(fast_s, duty_cycle)
    try:
        cycler.start()
        stream = read_stream(proxy.url, chat_body(tokens), timeout=60)
    finally:
        done.set()
        cycler.cancel()
        if cycler.is_alive():
            cycler.join()
        _resume(primary)
    moved = f"{primary.url} -> {fallback.url}"
    assert_left_once(stream, tokens, moved, "events/s over 1 s, down from")
    assert_counted(proxy, "slow")
