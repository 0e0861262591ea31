"""Measured memory pressure hands off live streams: a real mitmdump with the addon, real
llama-servers, and memory readings from real files or from the machine's own RAM."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from scripts.parts.processes import free_port
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.memfiles import FakeCard, mem_available_mib, mem_total_mib, write_meminfo
from scripts.testbed.mitm import ram_and_elsewhere, watch_sysfs
from tests.streams import assert_exact_splice, assert_one_clean_stream, chat_body, read_stream
from tests.test_routing import state_of, wait_for
from tests.test_splice import held

LONG = 800


@pytest.fixture
def watched(start_proxy, primary: LlamaServer, fallback: LlamaServer, tmp_path: Path):
    """A proxy whose watcher reads a sysfs tree: the primary on card0, the fallback on card1."""
    sysfs = tmp_path / "sys"
    cards = (
        FakeCard(sysfs, "card0", total_mib=16384, used_mib=10000),
        FakeCard(sysfs, "card1", total_mib=8192, used_mib=2000),
    )
    on = {primary.url: "drm:card0", fallback.url: "drm:card1"}
    return start_proxy(primary.url, [fallback.url], options=watch_sysfs(sysfs, on)), cards


def taken_at(
    chunk: int, proxy, server, take: Callable[[], object],
    seen: Callable[[dict], bool] | None = None,
) -> Callable[[int], None]:  # fmt: skip
    """An `on_chunk` that, once the client has `chunk` chunks, takes memory with `take()`
    while `server` is stopped (SIGSTOP), until the proxy's status shows it `seen` (by
    default: the live answer has left `server`). A tiny model writes the whole answer in
    a fraction of a second: on a loaded machine it could finish before the watcher's two
    readings, and nothing would be left to move."""

    def left(status: dict) -> bool:
        return bool(status["live"]) and status["live"][0]["server"] != server.url

    def on_chunk(n: int) -> None:
        if n != chunk:
            return
        with held(server):
            take()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if (seen or left)(httpx.get(proxy.url + "/spillover/status").json()):
                    return
                time.sleep(0.005)

    return on_chunk


def step_hands_off(proxy, card: FakeCard, used_mib: int, said: str, primary, fallback):
    """An answer through `proxy` whose card reaches `used_mib` at its 20th chunk: handed
    off once, its note saying `said`, the client's text the primary's then exactly the
    fallback's own continuation. The stream, for more checks."""
    take = taken_at(20, proxy, primary, lambda: card.set_used(used_mib))
    stream = read_stream(proxy.url, chat_body(LONG), on_chunk=take)
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert said in note, note
    assert_exact_splice(stream, primary.url, fallback.url, LONG)
    return stream


def test_a_step_on_the_primarys_card_hands_off(
    watched, primary: LlamaServer, fallback: LlamaServer
) -> None:
    proxy, (card0, _) = watched
    status = httpx.get(proxy.url + "/spillover/status").json()["memory"]
    assert status["alive"] and set(status["cards"]) == {"drm:card0", "drm:card1"}
    assert status["servers"][primary.url]["cards"] == ["drm:card0"]
    assert status["servers"][primary.url]["how"] == "explicit"
    said = "memory pressure on drm:card0: step +5,041 MiB, 1,343 MiB left, seen within"
    step_hands_off(proxy, card0, 15041, said, primary, fallback)
    metrics = httpx.get(proxy.url + "/spillover/metrics").text
    assert 'spillover_handoffs_total{kind="pressure"} 1.0' in metrics
    assert "spillover_pressure_detection_seconds_count 1.0" in metrics
    assert "spillover_handoff_pause_seconds_count 1.0" in metrics
    host = socket.gethostname()
    assert f'spillover_card_used_mib{{card="drm:card0",host="{host}"}} 15041.0' in metrics
    assert f'spillover_card_free_mib{{card="drm:card0",host="{host}"}} 1343.0' in metrics
    assert f'spillover_server_state{{server="{primary.url}",state="pressured"}} 1.0' in metrics
    assert "spillover_live_streams 0.0" in metrics


def test_pressure_on_a_card_the_stream_does_not_use_changes_nothing(
    watched, primary: LlamaServer
) -> None:
    proxy, (_, card1) = watched

    def fired(status: dict) -> bool:
        return status["memory"]["cards"]["drm:card1"]["fired"] == 1

    take = taken_at(20, proxy, primary, lambda: card1.set_used(8000), seen=fired)
    stream = read_stream(proxy.url, chat_body(LONG), on_chunk=take)
    assert_one_clean_stream(stream)
    assert stream.notes == []
    assert fired(httpx.get(proxy.url + "/spillover/status").json())


@pytest.mark.alone
def test_real_ram_pressure_hands_off_a_cpu_server(
    start_server, start_proxy, tmp_path: Path
) -> None:
    """The primary runs on the CPU, so its card is found to be system RAM; the test takes
    1,000 MiB of real memory with the free-memory line 400 MiB below what was free. The
    answer is long (larger slots) so the primary is still writing when the line is crossed
    (filling 1,000 MiB takes a while). The fallback stands for a server elsewhere (named on a
    card of a sysfs tree, so even a machine with eight NVIDIA cards reads nothing of its
    own for it): one in the same RAM would be passed over,
    as a handoff never goes onto the memory under pressure."""
    primary = start_server("primary", ctx_size=8192, slots=2)
    fallback = start_server("fallback", ctx_size=8192, slots=2)
    floor = int(mem_available_mib() - 400)
    proxy = start_proxy(
        primary.url,
        [fallback.url],
        options=[
            *ram_and_elsewhere(fallback.url, tmp_path / "sys"),
            f"spillover_free_floor_mib={floor}",
        ],
    )
    status = httpx.get(proxy.url + "/spillover/status").json()["memory"]
    assert status["servers"][primary.url]["cards"] == ["ram"]
    assert status["servers"][primary.url]["how"] == "ram"
    hog: list[bytes] = []
    stream = read_stream(
        proxy.url,
        chat_body(3000),
        on_chunk=lambda n: n == 2 and hog.append(b"\xff" * (1000 << 20)),
    )
    hog.clear()
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert "memory pressure on ram:" in note and "MiB free (floor" in note
    assert_exact_splice(stream, primary.url, fallback.url, 3000)


def test_a_broken_watcher_leaves_streams_on_the_primary(
    start_proxy, primary: LlamaServer, fallback: LlamaServer, tmp_path: Path
) -> None:
    proc = tmp_path / "proc"
    write_meminfo(proc / "meminfo", total_mib=24000, available_mib=20000)
    proxy = start_proxy(
        primary.url,
        [fallback.url],
        options=[f"spillover_proc_root={proc}", "spillover_sources=meminfo"],
    )
    (proc / "meminfo").write_text("\x00garbage")  # every read from now on fails
    stream = read_stream(proxy.url, chat_body(200))
    assert_one_clean_stream(stream)
    assert stream.notes == [] and stream.text == read_stream(primary.url, chat_body(200)).text
    status = httpx.get(proxy.url + "/spillover/status").json()["memory"]
    assert status["alive"] and "meminfo" in status["source_errors"]


def test_a_fallback_under_pressure_hands_off_again(
    start_server, start_proxy, primary: LlamaServer, fallback: LlamaServer, tmp_path: Path
) -> None:
    last = start_server("primary")  # the third rung, on its own card
    sysfs = tmp_path / "sys"
    card0 = FakeCard(sysfs, "card0", total_mib=16384, used_mib=10000)
    card1 = FakeCard(sysfs, "card1", total_mib=8192, used_mib=2000)
    FakeCard(sysfs, "card2", total_mib=8192, used_mib=2000)
    on = {primary.url: "drm:card0", fallback.url: "drm:card1", last.url: "drm:card2"}
    proxy = start_proxy(primary.url, [fallback.url, last.url], options=watch_sysfs(sysfs, on))
    # Both fallbacks known first: a handoff in the proxy's first moments can find the first
    # one not yet proven and take the other (seen under load: primary -> last).
    proxy.servers_known()

    # The primary's card fills; once the answer runs on the fallback, its card fills too
    # (each server held meanwhile: see taken_at).
    first = taken_at(20, proxy, primary, lambda: card0.set_used(15041))
    then = taken_at(20, proxy, fallback, lambda: card1.set_used(7800))

    def steps(n: int) -> None:
        first(n)
        then(n)

    stream = read_stream(proxy.url, chat_body(LONG), on_chunk=steps)
    assert_one_clean_stream(stream)
    assert [note.split(" -> ")[1].split()[0] for note in stream.notes] == [fallback.url, last.url]
    assert "memory pressure on drm:card1" in stream.notes[1]
    assert sum(stream.segment_tokens) == LONG


def test_never_onto_the_card_that_fired(
    start_server, start_proxy, primary: LlamaServer, fallback: LlamaServer, tmp_path: Path
) -> None:
    """The first fallback shares the primary's card: a step there passes it over, for the
    answer that moves and for a new request."""
    last = start_server("primary")  # the third rung, on a card of its own
    sysfs = tmp_path / "sys"
    card0 = FakeCard(sysfs, "card0", total_mib=16384, used_mib=10000)
    FakeCard(sysfs, "card2", total_mib=8192, used_mib=2000)
    on = {primary.url: "drm:card0", fallback.url: "drm:card0", last.url: "drm:card2"}
    proxy = start_proxy(primary.url, [fallback.url, last.url], options=watch_sysfs(sysfs, on))
    # Both fallbacks known first, so the first is passed over for its card alone (not for
    # being unproven yet, as a handoff in the proxy's first moments can find it).
    proxy.servers_known()
    take = taken_at(20, proxy, primary, lambda: card0.set_used(15041))
    stream = read_stream(proxy.url, chat_body(LONG), on_chunk=take)
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert f"{primary.url} -> {last.url} " in note and "memory pressure on drm:card0" in note
    states = httpx.get(proxy.url + "/spillover/status").json()["routing"]["states"]
    assert states[fallback.url]["state"] == "pressured"
    new = read_stream(proxy.url, chat_body(20))
    assert_one_clean_stream(new)
    why = "drm:card0: step +5,041 MiB, 1,343 MiB left"
    assert new.notes == [f": spillover: started on {last.url}: {primary.url} is pressured ({why})"]


def test_a_card_full_at_rest_keeps_its_answers_until_memory_is_taken(
    start_proxy, primary: LlamaServer, fallback: LlamaServer, tmp_path: Path
) -> None:
    """The primary's model fills its card: 2 % free (328 of 16,384 MiB), under the 512 MiB
    floor, dead flat. New answers start on the primary; another process taking 200 MiB
    from it mid-answer (more than half of what was free) hands that answer off."""
    sysfs = tmp_path / "sys"
    card0 = FakeCard(sysfs, "card0", total_mib=16384, used_mib=16056)
    FakeCard(sysfs, "card1", total_mib=8192, used_mib=2000)
    on = {primary.url: "drm:card0", fallback.url: "drm:card1"}
    proxy = start_proxy(primary.url, [fallback.url], options=watch_sysfs(sysfs, on))
    proxy.servers_known()
    card = httpx.get(proxy.url + "/spillover/status").json()["memory"]["cards"]["drm:card0"]
    assert card["armed"] and card["rest_free_mib"] == 328 and card["floor_mib"] == 164
    assert "full at rest: 328 MiB free" in card["acts_on"]
    for _ in range(2):  # new answers stay on the primary, whole
        calm = read_stream(proxy.url, chat_body(40))
        assert_one_clean_stream(calm)
        assert calm.notes == [] and calm.text == read_stream(primary.url, chat_body(40)).text
    states = httpx.get(proxy.url + "/spillover/status").json()["routing"]["states"]
    assert states[primary.url]["state"] == "ok"
    said = "memory pressure on drm:card0: 128 MiB free (floor 164)"
    step_hands_off(proxy, card0, 16256, said, primary, fallback)


def test_a_card_its_own_server_fills_while_loading_is_not_pressure(
    start_server, start_proxy, fallback: LlamaServer, tmp_path: Path
) -> None:
    """The proxy starts before its primary: while the primary is down (loading), its card
    goes from empty to full. Once the primary answers /health the card's rest is what its
    model left free, and new answers start there."""
    sysfs = tmp_path / "sys"
    card0 = FakeCard(sysfs, "card0", total_mib=16384, used_mib=600)
    FakeCard(sysfs, "card1", total_mib=8192, used_mib=2000)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    on = {url: "drm:card0", fallback.url: "drm:card1"}
    proxy = start_proxy(url, [fallback.url], options=watch_sysfs(sysfs, on))
    wait_for(proxy, url, "down")
    for used in (6000, 12000, 16056):  # the model loading
        card0.set_used(used)
        time.sleep(0.3)
    card = httpx.get(proxy.url + "/spillover/status").json()["memory"]["cards"]["drm:card0"]
    assert not card["armed"] and card["fired"] >= 1  # pressure while it loaded...
    primary = start_server("primary", port=port)
    wait_for(proxy, url, "ok", timeout=60)  # ... its own, once it is up
    card = httpx.get(proxy.url + "/spillover/status").json()["memory"]["cards"]["drm:card0"]
    assert card["armed"] and card["rest_free_mib"] == 328
    stream = read_stream(proxy.url, chat_body(40))
    assert_one_clean_stream(stream)
    assert stream.notes == [] and stream.text == read_stream(primary.url, chat_body(40)).text


def test_one_model_over_two_cards_hands_off_for_a_step_on_either(
    start_proxy, primary: LlamaServer, fallback: LlamaServer, tmp_path: Path
) -> None:
    """The primary's model is split over two 24 GiB cards (--tensor-split), each full at
    rest; the fallback is elsewhere. Memory taken on the second card hands the answer
    off; once it is back, new answers start on the primary again and memory taken on
    the first card hands the next one off."""
    sysfs = tmp_path / "sys"
    card0 = FakeCard(sysfs, "card0", total_mib=24576, used_mib=24076)
    card1 = FakeCard(sysfs, "card1", total_mib=24576, used_mib=23976)
    FakeCard(sysfs, "card2", total_mib=8192, used_mib=2000)
    on = {primary.url: "drm:card0+drm:card1", fallback.url: "drm:card2"}
    options = [*watch_sysfs(sysfs, on), "spillover_dwell_s=0"]
    proxy = start_proxy(primary.url, [fallback.url], options=options)
    proxy.servers_known()
    mapped = httpx.get(proxy.url + "/spillover/status").json()["memory"]["servers"]
    assert mapped[primary.url]["cards"] == ["drm:card0", "drm:card1"]
    for card, used, said in ((card1, 24276, "drm:card1: 300 MiB free"),
                             (card0, 24376, "drm:card0: 200 MiB free")):  # fmt: skip
        take = taken_at(20, proxy, primary, lambda c=card, u=used: c.set_used(u))
        stream = read_stream(proxy.url, chat_body(LONG), on_chunk=take)
        assert_one_clean_stream(stream)
        (note,) = stream.notes
        assert f"memory pressure on {said}" in note
        assert_exact_splice(stream, primary.url, fallback.url, LONG)
        card.set_used(used - 300)  # given back
        wait_for(proxy, primary.url, "ok")


def test_real_ram_under_its_floor_at_start_keeps_new_answers_on_the_primary(
    start_proxy, primary: LlamaServer, fallback: LlamaServer, tmp_path: Path
) -> None:
    """This machine's own RAM, with the floor set at all it has: full at rest, as a card its
    model fills. New answers start on the primary, whole; the line it acts on is half of
    what it had free. (The floor is not "a little above what is free now": tests beside
    this one free gigabytes between that reading and the proxy's.)"""
    floor = int(mem_total_mib())
    options = [
        *ram_and_elsewhere(fallback.url, tmp_path / "sys"),
        f"spillover_free_floor_mib={floor}",
    ]
    proxy = start_proxy(primary.url, [fallback.url], options=options)
    proxy.servers_known()
    ram = httpx.get(proxy.url + "/spillover/status").json()["memory"]["cards"]["ram"]
    assert ram["armed"] and ram["floor_mib"] < floor
    assert "full at rest" in ram["acts_on"] and "under its" in ram["acts_on"]
    stream = read_stream(proxy.url, chat_body(40))
    assert_one_clean_stream(stream)
    assert stream.notes == [] and stream.text == read_stream(primary.url, chat_body(40)).text
    assert state_of(proxy, primary.url) == "ok"
