"""New requests start where they are safe: away from a server whose card is under pressure
(until it has been clear for the dwell), away from a dead server (until it answers its
/health again), away from a drained one. Real llama-servers, a real mitmdump, memory
readings from a sysfs tree of real files."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from addon.answer.ladder import Ladder
from addon.servers.routing import Router
from addon.servers.upstream import Upstream
from scripts.bench.splice import MESSAGES, SseSource
from scripts.parts.processes import running
from scripts.parts.summary import server_lines
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.memfiles import FakeCard
from scripts.testbed.mitm import watch_sysfs
from tests.streams import assert_one_clean_stream, chat_body, direct_text, read_stream
from tests.test_splice import held

CONTROL = httpx.Client()


def routing_of(proxy, url: str) -> dict:
    """What the proxy's status says of a server's routing: its state, why, and more."""
    return CONTROL.get(f"{proxy.url}/spillover/status").json()["routing"]["states"][url]


def state_of(proxy, url: str) -> str:
    return routing_of(proxy, url)["state"]


def wait_for(proxy, url: str, state: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while (seen := state_of(proxy, url)) != state:
        assert time.monotonic() < deadline, f"{url} stayed {seen}, never {state}"
        time.sleep(0.02)


def whole(proxy, tokens: int = 24) -> httpx.Response:
    return CONTROL.post(
        f"{proxy.url}/v1/chat/completions", json={**chat_body(tokens), "stream": False}
    )


def watched_pair(start_server, start_proxy, tmp_path: Path, *options: str):
    """A primary on card0 and a fallback on card1 (8,192-token slots: room for the long
    answers below on either), behind a proxy whose watcher reads a sysfs tree."""
    primary = start_server("primary", ctx_size=16384, slots=2)
    fallback = start_server("fallback", ctx_size=16384, slots=2)
    sysfs = tmp_path / "sys"
    card0 = FakeCard(sysfs, "card0", total_mib=16384, used_mib=10000)
    FakeCard(sysfs, "card1", total_mib=8192, used_mib=2000)
    on = {primary.url: "drm:card0", fallback.url: "drm:card1"}
    proxy = start_proxy(primary.url, [fallback.url], options=[*watch_sysfs(sysfs, on), *options])
    proxy.servers_known()
    return primary, fallback, proxy, card0


def test_pressure_sends_new_requests_elsewhere_until_the_card_has_been_clear(
    start_server, start_proxy, tmp_path: Path
) -> None:
    primary, fallback, proxy, card0 = watched_pair(
        start_server, start_proxy, tmp_path, "spillover_dwell_s=1"
    )
    assert state_of(proxy, primary.url) == "ok"
    card0.set_used(15900)  # 484 MiB free: under the floor
    wait_for(proxy, primary.url, "pressured")
    stream = read_stream(proxy.url, chat_body(40))
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert f"started on {fallback.url}: {primary.url} is pressured (drm:card0" in note
    assert stream.text == direct_text(fallback.url, 40)
    reply = whole(proxy)
    assert reply.json()["choices"][0]["message"]["content"] == direct_text(fallback.url, 24)
    assert "is pressured" in reply.headers["x-spillover-route"]

    card0.set_used(10000)  # clear again: the primary gets new work after the dwell
    wait_for(proxy, primary.url, "pressured")  # still, within the dwell
    wait_for(proxy, primary.url, "ok")
    stream = read_stream(proxy.url, chat_body(40))
    assert stream.notes == [] and stream.text == direct_text(primary.url, 40)
    routing = CONTROL.get(f"{proxy.url}/spillover/status").json()["routing"]
    assert routing["reroutes"] == {"pressured": 2}
    metrics = CONTROL.get(f"{proxy.url}/spillover/metrics").text
    assert 'spillover_reroutes_total{state="pressured"} 2.0' in metrics
    assert f'spillover_server_state_seconds_total{{server="{primary.url}",state="pressured"}}' in (
        metrics
    )


def test_a_dead_primary_is_skipped_until_it_answers_again(
    start_server, start_proxy, fallback: LlamaServer
) -> None:
    primary, proxy = private_primary(start_server, start_proxy, fallback)
    primary.kill()
    first = read_stream(proxy.url, chat_body(20))  # refused: starts on the fallback
    assert_one_clean_stream(first)
    # Found dead by the refused connection, or by /health if it asked in between.
    assert "cannot connect" in first.notes[0] or "is down" in first.notes[0]
    down = CONTROL.get(f"{proxy.url}/spillover/status").json()["routing"]["states"]
    assert down[primary.url]["state"] == "down" and down[primary.url]["for_s"] >= 0
    second = read_stream(proxy.url, chat_body(20))
    assert_one_clean_stream(second)
    (note,) = second.notes  # not tried at all: it starts where it can
    assert f"started on {fallback.url}: {primary.url} is down" in note
    revived = start_server("primary", port=primary.port)
    wait_for(proxy, primary.url, "ok")
    third = read_stream(proxy.url, chat_body(20))
    assert third.notes == [] and third.text == direct_text(revived.url, 20)


def test_drain_moves_live_answers_and_keeps_new_ones_away(
    start_server, start_proxy, fallback: LlamaServer
) -> None:
    primary, proxy = private_primary(start_server, start_proxy, fallback)
    drained: list[dict] = []

    def drain(n: int) -> None:
        if n == 20:
            with held(primary):
                reply = CONTROL.post(f"{proxy.url}/spillover/drain", json={"server": primary.url})
                drained.append(reply.json())

    stream = read_stream(proxy.url, chat_body(600), on_chunk=drain)
    assert drained == [{"server": primary.url, "moving": 1, "live": 1}]
    assert_one_clean_stream(stream)
    assert f"{primary.url} is draining" in stream.notes[0]
    assert state_of(proxy, primary.url) == "draining"
    status = CONTROL.get(f"{proxy.url}/spillover/status").json()["routing"]
    assert status["live_per_server"][primary.url] == 0
    later = read_stream(proxy.url, chat_body(20))
    assert f"{primary.url} is draining" in later.notes[0]
    assert later.text == direct_text(fallback.url, 20)
    CONTROL.post(f"{proxy.url}/spillover/undrain", json={"server": primary.url})
    assert state_of(proxy, primary.url) == "ok"
    back = read_stream(proxy.url, chat_body(20))
    assert back.notes == [] and back.text == direct_text(primary.url, 20)


def private_primary(start_server, start_proxy, fallback: LlamaServer, *options: str):
    """A primary of the test's own (to kill or stop) and the shared fallback, behind a proxy."""
    primary = start_server("primary")
    proxy = start_proxy(primary.url, [fallback.url], options=list(options))
    proxy.servers_known()
    return primary, proxy


def live_on(proxy, url: str, timeout: float = 5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = CONTROL.get(f"{proxy.url}/spillover/status").json()["live"]
        if live and live[0]["server"] == url:
            return True
        time.sleep(0.005)
    return False


def test_an_answer_goes_back_to_the_primary_once_its_card_is_clear(
    start_server, start_proxy, tmp_path: Path
) -> None:
    primary, fallback, proxy, card0 = watched_pair(
        start_server, start_proxy, tmp_path,
        "spillover_hand_back=true", "spillover_dwell_s=0", "spillover_hand_back_min_tokens=50",
    )  # fmt: skip
    moved_back: list[bool] = []

    def steps(n: int) -> None:
        if n != 20:
            return
        card0.set_used(15900)  # the answer moves to the fallback...
        assert live_on(proxy, fallback.url)
        with held(fallback):  # ...and, held there, comes back once card0 is clear
            card0.set_used(10000)
            moved_back.append(live_on(proxy, primary.url))

    stream = read_stream(proxy.url, chat_body(4000), on_chunk=steps)
    assert moved_back == [True]
    assert_one_clean_stream(stream)
    away, back = stream.notes
    assert f"{primary.url} -> {fallback.url}" in away and "memory pressure on drm:card0" in away
    assert f"{fallback.url} -> {primary.url}" in back and "is clear again" in back
    assert sum(stream.segment_tokens) == 4000
    metrics = CONTROL.get(f"{proxy.url}/spillover/metrics").text
    assert 'spillover_handoffs_total{kind="handback"} 1.0' in metrics


def test_a_counter_flapping_around_the_line_moves_an_answer_once(
    start_server, start_proxy, tmp_path: Path
) -> None:
    """Over the floor (484 MiB free), then just under it (784 MiB free, not clearly
    below the lines): the card fired once and is never clear, so the answer moves once
    and does not come back, and new requests stay off the card."""
    primary, fallback, proxy, card0 = watched_pair(
        start_server, start_proxy, tmp_path, "spillover_hand_back=true", "spillover_dwell_s=0"
    )
    flaps: list[int] = []

    def flap(n: int) -> None:
        if n >= 20 and n % 40 == 0 and len(flaps) < 12:
            flaps.append(n)
            card0.set_used(15900 if len(flaps) % 2 else 15600)
            time.sleep(0.05)  # a few samples at each level

    stream = read_stream(proxy.url, chat_body(3000), on_chunk=flap)
    assert_one_clean_stream(stream)
    assert len(stream.notes) == 1 and f"{primary.url} -> {fallback.url}" in stream.notes[0]
    assert state_of(proxy, primary.url) == "pressured"


def test_a_hung_primary_is_found_by_its_health_before_any_request_waits_on_it(
    start_server, start_proxy, fallback: LlamaServer
) -> None:
    primary, proxy = private_primary(start_server, start_proxy, fallback)
    with held(primary):
        wait_for(proxy, primary.url, "down")
        stream = read_stream(proxy.url, chat_body(20))
        assert_one_clean_stream(stream)
        (note,) = stream.notes  # one note: it started there, the primary was never asked
        assert f"started on {fallback.url}: {primary.url} is down (/health: " in note
    wait_for(proxy, primary.url, "ok")


def test_a_requested_handoff_is_not_handed_back(
    start_proxy, primary: LlamaServer, fallback: LlamaServer
) -> None:
    """A person moved it: the primary being ok does not undo that."""
    proxy = start_proxy(primary.url, [fallback.url], options=["spillover_hand_back=true"])
    proxy.servers_known()

    def ask(n: int) -> None:
        if n == 20:
            with held(primary):
                CONTROL.post(f"{proxy.url}/spillover/handoff")
            assert live_on(proxy, fallback.url)
            with held(fallback):  # still live there for two pace ticks, the primary ok
                time.sleep(0.6)

    stream = read_stream(proxy.url, chat_body(600), on_chunk=ask)
    assert_one_clean_stream(stream)
    assert len(stream.notes) == 1 and f"{primary.url} -> {fallback.url}" in stream.notes[0]


def test_the_ladder_passes_over_pressured_servers_unless_all_else_failed() -> None:
    servers = [Upstream(f"http://s{i}") for i in range(4)]
    states = {"http://s1": "pressured", "http://s2": "down", "http://s3": "ok"}
    ladder = Ladder(servers, lambda url: states.get(url, "ok"))
    assert ladder.below() == [3]  # not the pressured one, not the one down
    ladder.at = 3
    assert ladder.after_failure() == 0  # back up to the primary first...
    ladder.at = 0
    assert ladder.after_failure() == 1  # ...and the pressured one only when it failed too


def test_a_server_slow_to_answer_health_while_it_streams_is_busy_not_down(
    start_proxy, tmp_path: Path
) -> None:
    """vLLM answers /health on the event loop its streams keep busy, so under load it is
    seconds late (vllm-project/vllm#38157 saw 30-40 s). A server that wrote to a live
    answer while its /health went unanswered is busy, not hung: it stays up and takes
    new requests; the same silence with nothing streaming from it is taken as a hang, as
    before. Stand-in upstreams (scripts/testbed/sse_source.py): no real server is slow
    to answer /health on demand."""
    first, second = SseSource(log_dir=tmp_path), SseSource(log_dir=tmp_path)
    with running(first, second):
        proxy = start_proxy(first.url, [second.url])

        def meanwhile(n: int) -> None:
            if n != 2:
                return
            late_health(first, 3)
            seen = judged_health(proxy, first.url)
            assert seen["state"] == "ok" and seen["health"] == "slow while it streams", seen
            another = read_stream(proxy.url, STANDIN_BODY)
            assert another.done == 1 and not another.errors and len(another.chunks) == 4
            assert another.notes == [], "a new request started elsewhere"

        stream = read_stream(proxy.url, {**STANDIN_BODY, "max_tokens": 400}, on_chunk=meanwhile)
        assert stream.done == 1 and not stream.errors and len(stream.chunks) == 401
        assert stream.notes == []
        wait_for(proxy, first.url, "down")  # nothing streams from it now: hung, as before
        said = routing_of(proxy, first.url)
        assert said["why"] == "/health: no answer in 1 s" and "health" not in said, said
        late_health(first, 0)
        wait_for(proxy, first.url, "ok")


def test_a_server_slow_to_answer_health_while_its_processes_work_is_busy_not_down(
    start_proxy, tmp_path: Path
) -> None:
    """Loaded by other clients, with nothing streaming through this proxy, vLLM's /health
    is as late: the CPU the processes holding its port use tell a loaded server from a
    hung one. Stand-in upstreams: no real server holds its event loop on demand."""
    first, second = SseSource(log_dir=tmp_path), SseSource(log_dir=tmp_path)
    with running(first, second):
        proxy = start_proxy(first.url, [second.url])
        wait_for(proxy, first.url, "ok")
        late_health(first, 2, busy=True)  # its event loop held, working, as a loaded one's
        seen = judged_health(proxy, first.url)
        assert seen["state"] == "ok" and seen["health"] == "slow while its processes work"
        said = server_lines(proxy.status())[1]  # as `spillover status` says it
        assert f"{first.url} (primary): ok (/health slow while its processes work);" in said
        slow = f'{{server="{first.url}",why="while its processes work"}} 1.0'
        assert f"spillover_server_health_slow{slow}" in metrics_of(proxy)
        late_health(first, 2, busy=False)  # waiting, not working: as a hung one's
        wait_for(proxy, first.url, "down")
        said = routing_of(proxy, first.url)
        assert said["why"] == "/health: no answer in 1 s" and "health" not in said, said
        assert "spillover_server_health_slow{" not in metrics_of(proxy)
        late_health(first, 0)
        wait_for(proxy, first.url, "ok")


def test_a_server_whose_health_goes_unanswered_past_the_limit_is_down(tmp_path: Path) -> None:
    """However busy its processes, a /health unanswered for SLOW_HEALTH_LIMIT_S is a
    down server's: a new request would wait as long to start. The router alone, in this
    process (with a limit of one second); a stand-in upstream, as above."""
    first = SseSource(log_dir=tmp_path)
    with running(first):
        late_health(first, 2, busy=True)
        router = Router()
        router.slow_limit_s = 1.0
        seen: list[tuple[str, str | None]] = []

        async def watch() -> None:
            task = asyncio.create_task(router.watch_health(lambda: [first.url], 0.1))
            deadline = time.monotonic() + 20
            try:
                while (state := router.state(first.url))[0] != "down":
                    assert time.monotonic() < deadline, f"never down: {seen}"
                    if first.url in router.slow_health and state not in seen:
                        seen.append(state)
                    await asyncio.sleep(0.02)
            finally:
                task.cancel()

        asyncio.run(watch())
        assert seen == [("ok", None)], "it was busy, not down, before the limit"
        assert router.state(first.url) == ("down", "/health: no answer in 1 s")
        late_health(first, 0)


def late_health(server: SseSource, seconds: float, busy: bool = False) -> None:
    """The stand-in's /health answers `seconds` late, its event loop held working (busy)
    or waiting. (The stand-in may be working through a late answer: it reads this after.)"""
    CONTROL.post(
        f"{server.url}/bench/health-delay", json={"seconds": seconds, "busy": busy}, timeout=30
    )


def metrics_of(proxy) -> str:
    return CONTROL.get(f"{proxy.url}/spillover/metrics").text


def judged_health(proxy, url: str) -> dict:
    """The server's routing once a /health of its has timed out and been judged."""
    deadline = time.monotonic() + 10
    while "health" not in (seen := routing_of(proxy, url)) and seen["state"] == "ok":
        assert time.monotonic() < deadline, "no /health timed out"
        time.sleep(0.05)
    return seen


# A stand-in's answer at a decode step's pace (25 ms a token): 3 tokens unless longer.
STANDIN_BODY = {
    "stream": True, "max_tokens": 3, "interval_ms": 25,
    "messages": MESSAGES,
}  # fmt: skip
