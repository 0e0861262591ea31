"""Cards on other hosts, read through a real Prometheus (Debian's) scraping a real
node_exporter (drm collector on a tree of real amdgpu files) and a second spillover
proxy's /spillover/metrics. Loopback addresses stand for hosts: the primary A on
127.0.0.2 (its card from node_exporter there), the fallback B on 127.0.0.3 (its card from
the proxy in front of it there), the fallback C on this machine (a local sysfs card).

The tests run in order on one bed: each leaves the cards as it found them, except the
last two, which kill node_exporter and then Prometheus.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from scripts.testbed.fleet import NodeExporter, Prometheus, not_installed
from scripts.testbed.memfiles import FakeCard
from scripts.testbed.mitm import REPO
from tests.streams import assert_one_clean_stream, chat_body, read_stream
from tests.test_splice import handoff_after, held

SCRAPE_S = 1.0
TOTAL, CALM, STEP = 16384, 1000, 15500  # MiB: a step of 14.5 GiB leaves 884 MiB free
WAIT_S = 20.0  # far more than two scrapes and a query: a loaded machine is slow
A_CARD = "prom:127.0.0.2:card0"


@pytest.fixture(scope="module")
def fleet(start_server_module, start_proxy_module, tmp_path_factory, server_logs):
    if (why := not_installed()) is not None:
        pytest.skip(f"Prometheus and node_exporter: {why} (scripts/setup.sh installs them as root)")
    root = tmp_path_factory.mktemp("fleet")
    a_card = FakeCard(root / "a-sys", "card0", total_mib=TOTAL, used_mib=CALM)
    b_card = FakeCard(root / "b-sys", "card0", total_mib=TOTAL, used_mib=CALM)
    c_card = FakeCard(root / "c-sys", "card0", total_mib=TOTAL, used_mib=CALM)
    a = start_server_module("primary", host="127.0.0.2")
    b = start_server_module("fallback", host="127.0.0.3")
    c = start_server_module("fallback")
    exporter = NodeExporter(root / "a-sys", host="127.0.0.2", log_dir=server_logs).start()
    b_proxy = start_proxy_module(
        b.url, [], host="127.0.0.3",
        options=[
            f"spillover_sysfs_root={root / 'b-sys'}", "spillover_sources=sysfs",
            f"spillover_cards={b.url}=drm:card0",
        ],
    )  # fmt: skip
    prometheus = Prometheus(
        [f"127.0.0.2:{exporter.port}", f"127.0.0.3:{b_proxy.port}/spillover/metrics"],
        every_s=SCRAPE_S, log_dir=server_logs,
    ).start()  # fmt: skip
    proxy = start_proxy_module(
        a.url, [b.url, c.url],
        options=[
            f"spillover_prometheus={prometheus.url}", "spillover_prometheus_interval_ms=250",
            f"spillover_sysfs_root={root / 'c-sys'}", "spillover_sources=sysfs",
            f"spillover_cards={c.url}=drm:card0", "spillover_dwell_s=1",
        ],
    )  # fmt: skip
    proxy.servers_known()
    bed = {"a": a, "b": b, "c": c, "proxy": proxy, "prometheus": prometheus}
    bed |= {"exporter": exporter, "a_card": a_card, "b_card": b_card, "c_card": c_card}
    yield bed
    prometheus.stop()
    exporter.stop()


def wait_state(proxy, server, wanted: str) -> dict:
    deadline = time.monotonic() + WAIT_S
    while (now := proxy.status())["routing"]["states"][server.url]["state"] != wanted:
        assert time.monotonic() < deadline, now["routing"]["states"]
        time.sleep(0.05)
    return now


def test_remote_cards_are_read_and_mapped_by_host(fleet) -> None:
    proxy, a, b = fleet["proxy"], fleet["a"], fleet["b"]
    a_card, b_card = A_CARD, f"prom:{socket.gethostname()}:drm:card0"
    deadline = time.monotonic() + WAIT_S
    while not {a_card, b_card} <= set((now := proxy.status())["memory"]["cards"]) or any(
        seen["scraped_every_s"] is None for seen in now["memory"]["prometheus"]["cards"].values()
    ):  # (its scrape interval is known from its second sample on)
        assert time.monotonic() < deadline, now["memory"]
        time.sleep(0.05)
    memory = now["memory"]
    for card in (a_card, b_card):
        assert memory["cards"][card]["used_mib"] == CALM, memory["cards"][card]
        assert memory["cards"][card]["total_mib"] == TOTAL, memory["cards"][card]
    assert memory["servers"][a.url]["cards"] == [a_card], memory["servers"][a.url]
    assert memory["servers"][a.url]["how"] == "prometheus"
    assert memory["servers"][b.url]["cards"] == [b_card], memory["servers"][b.url]
    exporters = {card: seen["exporter"] for card, seen in memory["prometheus"]["cards"].items()}
    assert exporters == {a_card: "node-drm", b_card: "spillover"}, memory["prometheus"]
    assert memory["prometheus"]["cards"][a_card]["scraped_every_s"] == pytest.approx(SCRAPE_S, 0.2)
    # Waited for, not read once: on a loaded machine a scrape or query that comes late
    # leaves a remote card stale, so unknown, for a moment (never fine: the product's rule).
    for server in (a, b, fleet["c"]):
        wait_state(proxy, server, "ok")
    doctor = run_doctor(fleet)
    assert f"ok  {a_card}: 1,000 of 16,384 MiB used" in doctor, doctor
    assert "[node-drm, hosts 127.0.0.2; scraped" in doctor and ": fresh]" in doctor, doctor
    assert f"{a.url}: llama-server" in doctor and f"cards: {a_card} (by prometheus" in doctor


def run_doctor(fleet) -> str:
    servers = ",".join(fleet[name].url for name in "abc")
    command = [
        sys.executable, "-m", "scripts.doctor", "--servers", servers,
        "--prometheus", fleet["prometheus"].url,
    ]  # fmt: skip
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True).stdout


def test_a_step_on_the_remote_primarys_card_hands_off_and_reroutes(fleet) -> None:
    proxy, a, b = fleet["proxy"], fleet["a"], fleet["b"]

    def step_while_held(n: int) -> None:
        if n == 20:
            with held(a):  # the answer waits on A until the pressure is seen
                fleet["a_card"].set_used(STEP)
                deadline = time.monotonic() + WAIT_S
                while proxy.status()["memory"]["cards"][A_CARD]["armed"]:
                    assert time.monotonic() < deadline, proxy.status()["memory"]
                    time.sleep(0.05)

    stream = read_stream(proxy.url, chat_body(200), on_chunk=step_while_held)
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert f"-> {b.url}" in note and f"memory pressure on {A_CARD}: step" in note, note
    # Confirmed by the next scrape, not by the same sample read again.
    (moved,) = [h for h in proxy.status()["recent_handoffs"] if h["kind"] == "pressure"]
    assert moved["crossed_ms"] >= 0.8 * SCRAPE_S * 1000, moved
    wait_state(proxy, a, "pressured")  # (held, A missed a health check: down for a moment)
    new = read_stream(proxy.url, chat_body(8))
    assert_one_clean_stream(new)
    (started,) = new.notes
    assert f"started on {b.url}: {a.url} is pressured ({A_CARD}" in started, started
    fleet["a_card"].set_used(CALM)
    wait_state(proxy, a, "ok")  # cleared on a later scrape, then the dwell


def test_a_pressured_remote_fallback_is_passed_over(fleet) -> None:
    """B's card is read through the proxy in front of B: its metrics, scraped."""
    proxy, a, b, c = fleet["proxy"], fleet["a"], fleet["b"], fleet["c"]
    fleet["b_card"].set_used(STEP)
    seen = wait_state(proxy, b, "pressured")
    assert "drm:card0: step" in seen["routing"]["states"][b.url]["why"], seen["routing"]
    stream = read_stream(proxy.url, chat_body(200), on_chunk=handoff_after(proxy, 20, hold=a))
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert f"-> {c.url}" in note, note
    fleet["b_card"].set_used(CALM)
    wait_state(proxy, b, "ok")


def test_a_stale_series_is_not_trusted(fleet) -> None:
    proxy, a = fleet["proxy"], fleet["a"]
    fleet["exporter"].stop()  # Prometheus still answers; A's series stops being scraped
    seen = wait_state(proxy, a, "unknown")
    card = seen["memory"]["cards"][A_CARD]
    assert card["error"].startswith("stale: no reading for"), card
    doctor = run_doctor(fleet)
    assert f"--  {A_CARD}: 1,000 of 16,384 MiB used" in doctor and "STALE: unknown" in doctor
    # Not knowing is no reason to leave the primary: the answer stays there, whole.
    stream = read_stream(proxy.url, chat_body(16))
    assert_one_clean_stream(stream)
    assert stream.notes == []


def test_prometheus_gone_leaves_local_protection_as_it_was(fleet) -> None:
    proxy, a, b, c = fleet["proxy"], fleet["a"], fleet["b"], fleet["c"]
    fleet["prometheus"].kill()
    seen = wait_state(proxy, b, "unknown")
    b_card = seen["memory"]["cards"][f"prom:{socket.gethostname()}:drm:card0"]
    assert b_card["error"].startswith(f"prometheus {fleet['prometheus'].url}:"), b_card
    assert seen["memory"]["prometheus"]["error"], seen["memory"]["prometheus"]
    samples = seen["memory"]["samples"]
    fleet["c_card"].set_used(STEP)  # the local card is watched as before
    seen = wait_state(proxy, c, "pressured")
    assert seen["memory"]["samples"] > samples
    # An asked-for handoff takes the unknown fallback before the pressured one.
    stream = read_stream(proxy.url, chat_body(200), on_chunk=handoff_after(proxy, 20, hold=a))
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert f"-> {b.url}" in note, note
    fleet["c_card"].set_used(CALM)


def test_proxies_side_by_side_carry_answers_without_coordinating(
    start_proxy, primary, fallback
) -> None:
    """Two proxies in front of the same servers, as behind a balancer: each answer's
    state lives in its own stream, so answers alternating between them are each handed
    off by the proxy carrying it, and each ends whole."""
    proxies = [start_proxy(primary.url, [fallback.url]) for _ in range(2)]
    for proxy in proxies:
        proxy.servers_known()
    for n in range(4):
        proxy = proxies[n % 2]
        stream = read_stream(
            proxy.url, chat_body(120), on_chunk=handoff_after(proxy, 10 + n, hold=primary)
        )
        assert_one_clean_stream(stream)
        (note,) = stream.notes
        assert f"-> {fallback.url}" in note, note
    for proxy in proxies:
        handoffs = proxy.status()["recent_handoffs"]
        assert len(handoffs) == 2, handoffs
