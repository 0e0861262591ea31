"""A GPU box on its second day, with real llama-servers behind a real mitmdump: memory
another program takes and keeps, then the primary's again; a second step while its card
is pressured; the primary's own model unloaded and loaded again behind its open port.
Memory is read from stand-in trees (sysfs, and /proc with DRM fdinfo counters for the
real primary's process), as no card is here."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.memfiles import FakeCard, FakeProcess, write_in_place
from scripts.testbed.mitm import watch_sysfs
from tests.streams import assert_exact_splice, assert_one_clean_stream, chat_body, read_stream
from tests.test_cli import spillover
from tests.test_pressure_handoff import step_hands_off, taken_at
from tests.test_routing import CONTROL, state_of, wait_for
from watchers.gates import REFRESH_SECONDS

LONG = 800
SETTLE_S = 3  # spillover_settle_s here (30 by default)


def memory(proxy) -> dict:
    return CONTROL.get(f"{proxy.url}/spillover/status").json()["memory"]


def started_on(stream, server: str) -> bool:
    return any(f"started on {server}" in note for note in stream.notes)


@pytest.fixture
def two_cards(start_proxy, primary: LlamaServer, fallback: LlamaServer, tmp_path: Path):
    sysfs = tmp_path / "sys"
    card0 = FakeCard(sysfs, "card0", total_mib=16384, used_mib=10000)
    FakeCard(sysfs, "card1", total_mib=8192, used_mib=2000)
    on = {primary.url: "drm:card0", fallback.url: "drm:card1"}
    options = [*watch_sysfs(sysfs, on), f"spillover_settle_s={SETTLE_S}"]
    return start_proxy(primary.url, [fallback.url], options=options), card0


def test_memory_kept_then_the_primary_again_then_a_second_step(
    two_cards, primary: LlamaServer, fallback: LlamaServer
) -> None:
    proxy, card0 = two_cards
    said = "memory pressure on drm:card0: step +5,041 MiB, 1,343 MiB left"
    step_hands_off(proxy, card0, 15041, said, primary, fallback)
    # The program keeps what it took: new answers go to the fallback meanwhile...
    assert state_of(proxy, primary.url) == "pressured"
    assert started_on(read_stream(proxy.url, chat_body(20)), fallback.url)
    # ... until the card has held still for the settle time: that is its rest now.
    wait_for(proxy, primary.url, "ok", timeout=SETTLE_S + 10)
    card = memory(proxy)["cards"]["drm:card0"]
    assert card["rest_free_mib"] == 1343 and card["armed"]
    assert card["state"] == f"at rest since: held still {SETTLE_S} s"
    back = read_stream(proxy.url, chat_body(20))
    assert_one_clean_stream(back)
    assert back.notes == []  # the primary's answer, nothing said
    # The next step hands off again, its lines counted from the new rest.
    said = "memory pressure on drm:card0: 243 MiB free (floor 512)"
    step_hands_off(proxy, card0, 16141, said, primary, fallback)


def test_a_second_step_while_pressured_moves_what_started_there(
    two_cards, primary: LlamaServer, fallback: LlamaServer
) -> None:
    """The card fired; an answer starts on its server anyway (the fallback was drained,
    and pressured beats nowhere); a further step moves it."""
    proxy, card0 = two_cards
    card0.set_used(13500)  # a first step, 2,884 MiB left: fires, no answer to move
    wait_for(proxy, primary.url, "pressured")
    CONTROL.post(f"{proxy.url}/spillover/drain", json={"server": fallback.url})

    def second_step(n: int) -> None:
        if n == 20:
            CONTROL.post(f"{proxy.url}/spillover/undrain", json={"server": fallback.url})
            card0.set_used(15800)  # +2,300 MiB, 584 MiB left

    stream = read_stream(proxy.url, chat_body(LONG), on_chunk=second_step)
    assert_one_clean_stream(stream)
    assert not started_on(stream, fallback.url)
    (note,) = [n for n in stream.notes if "memory pressure" in n]
    assert "memory pressure on drm:card0: step +2,300 MiB, 584 MiB left" in note
    assert_exact_splice(stream, primary.url, fallback.url, LONG)
    assert memory(proxy)["cards"]["drm:card0"]["fired"] == 2


class DrmHeld:
    """The DRM fdinfo counters of one process in a /proc tree: what it holds on card0."""

    def __init__(self, process: FakeProcess, client: int) -> None:
        self.client = client
        self.fdinfo = process.dir / "fdinfo" / process.open("/dev/dri/renderD128").name
        self.fdinfo.parent.mkdir(exist_ok=True)

    def hold(self, mib: int) -> None:
        write_in_place(
            self.fdinfo,
            f"pos:\t0\ndrm-driver:\tamdgpu\ndrm-pdev:\t0000:03:00.0\n"
            f"drm-client-id:\t{self.client}\ndrm-resident-vram:\t{mib * 1024} KiB\n",
        )


def test_the_primarys_model_unloaded_and_loaded_again_is_never_pressure(
    start_proxy, primary: LlamaServer, fallback: LlamaServer, tmp_path: Path
) -> None:
    """llama-swap's ttl or Ollama's keep_alive: the primary's port stays open while its
    model leaves the card and comes back. DRM fdinfo says whose memory that is (the
    primary's real pid, found by its listening socket), so nothing fires; another
    program's step afterwards still hands off."""
    proc, sysfs = tmp_path / "proc", tmp_path / "sys"
    FakeCard(sysfs, "card0", total_mib=24576, used_mib=0, pdev="0000:03:00.0")
    server = FakeProcess(proc, primary.pid)
    server.listen(int(primary.url.rsplit(":", 1)[1]), inode=424242)
    model = DrmHeld(server, client=1)
    model.hold(23 * 1024)
    other = DrmHeld(FakeProcess(proc, os.getpid() + 100000, "desktop"), client=2)
    other.hold(200)
    proxy = start_proxy(
        primary.url,
        [fallback.url],
        options=[
            f"spillover_proc_root={proc}",
            f"spillover_sysfs_root={sysfs}",
            "spillover_sources=fdinfo",
            f"spillover_settle_s={SETTLE_S * 10}",  # no settling: whose memory it is says all
        ],
    )
    # A mapping made before the fdinfo source's first reading names no card, and is
    # looked up again REFRESH_SECONDS later (on a loaded machine the proxy may answer first).
    deadline = time.monotonic() + REFRESH_SECONDS + 10
    while (cards := memory(proxy)["servers"][primary.url]["cards"]) != ["drm:card0"]:
        assert time.monotonic() < deadline, cards
        time.sleep(0.2)
    # The fdinfo source looks for new descriptors every 5 s; its counters, every sample.
    for held_mib in (0, 6 * 1024, 14 * 1024, 23 * 1024):
        model.hold(held_mib)
        time.sleep(0.5)
    card = memory(proxy)["cards"]["drm:card0"]
    assert card["fired"] == 0 and card["armed"], card
    assert card["own_mib"] == 23 * 1024
    holders = {h["pid"]: h for h in card["holders"]}
    assert holders[primary.pid]["server"] and not holders[other_pid(other)]["server"]
    said = spillover("status", "--proxy", proxy.url).stdout
    assert f"held by: llama-server {primary.pid} (a server) 23,552 MiB, desktop" in said
    assert state_of(proxy, primary.url) == "ok"
    take = taken_at(20, proxy, primary, lambda: other.hold(200 + 800))
    stream = read_stream(proxy.url, chat_body(LONG), on_chunk=take)
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert "memory pressure on drm:card0" in note
    assert_exact_splice(stream, primary.url, fallback.url, LONG)
    httpx.get(primary.url + "/health").raise_for_status()


def other_pid(held: DrmHeld) -> int:
    return int(held.fdinfo.parent.parent.name)
