"""Hung and slow servers are left: a leg that stops sending (SIGSTOP) is dropped like a
failed one, and one that slows far below its own pace (a SIGSTOP/SIGCONT duty cycle, as
when a card's memory spills into system RAM) moves on like an asked-for handoff."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx

from tests.streams import assert_one_clean_stream, chat_body, read_stream

QUICK = ["spillover_stall_s=1", "spillover_first_token_s=2"]


def _stop(server) -> None:
    os.kill(server.pid, signal.SIGSTOP)


def _resume(server) -> None:
    os.kill(server.pid, signal.SIGCONT)


def test_a_stalled_primary_is_left_for_the_fallback(start_server, start_proxy, fallback) -> None:
    primary = start_server("primary")
    proxy = start_proxy(primary.url, [fallback.url], options=QUICK)
    try:
        stream = read_stream(
            proxy.url, chat_body(600), on_chunk=lambda n: n == 50 and _stop(primary)
        )
    finally:
        _resume(primary)
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert f"{primary.url} -> {fallback.url}" in note and "nothing for 1." in note
    assert sum(stream.segment_tokens) == 600
    metrics = httpx.get(f"{proxy.url}/spillover/metrics").text
    assert 'spillover_handoffs_total{kind="stalled"} 1.0' in metrics


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
    # 4,096-token slots: room for the whole answer on either server.
    primary = start_server("primary", ctx_size=16384)
    fallback = start_server("fallback", ctx_size=16384)
    options = ["spillover_slow_percent=25", "spillover_slow_window_s=1"]
    proxy = start_proxy(primary.url, [fallback.url], options=options)
    slowed, done = threading.Event(), threading.Event()

    def duty_cycle() -> None:
        """Runs the primary 10 ms in every 200: about 20 times slower."""
        slowed.set()
        while not done.is_set():
            _stop(primary)
            time.sleep(0.19)
            _resume(primary)
            time.sleep(0.01)

    cycler = threading.Thread(target=duty_cycle)

    def on_chunk(n: int) -> None:
        if n == 200:
            cycler.start()

    try:
        stream = read_stream(proxy.url, chat_body(3000), on_chunk=on_chunk, timeout=30)
    finally:
        done.set()
        if slowed.is_set():
            cycler.join()
        _resume(primary)
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert f"{primary.url} -> {fallback.url}" in note and "events/s over 1 s, down from" in note
    assert sum(stream.segment_tokens) == 3000
    metrics = httpx.get(f"{proxy.url}/spillover/metrics").text
    assert 'spillover_handoffs_total{kind="slow"} 1.0' in metrics
