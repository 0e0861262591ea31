"""Remote cards without a network: the exporters' series as Prometheus answers them
(the query API's JSON, written here as it documents it), selectors, and how the
monitor treats readings that arrive at their own pace. The real Prometheus and
node_exporter are in test_fleet.py."""

from __future__ import annotations

import time

import httpx
import pytest

from addon.answer.ladder import Ladder
from addon.servers.routing import Router
from addon.servers.upstream import Upstream
from watchers.exporters import cards_of, host_of, query, series_of
from watchers.monitor import MemoryMonitor
from watchers.pressure import Lines
from watchers.prometheus import PrometheusSource, parse_selectors
from watchers.reading import MIB, CardFailure, Reading

LINES = Lines(step_mib=1024, rearm_mib=1024)


def matrix(name: str, labels: dict[str, str], *samples: tuple[float, float]) -> dict:
    return {"metric": {"__name__": name, **labels}, "values": [[t, str(v)] for t, v in samples]}


DCGM = {"gpu": "1", "UUID": "GPU-abc", "Hostname": "gpu7", "instance": "10.0.0.7:9400"}
NODE = {"card": "card0", "instance": "10.0.0.8:9100", "job": "node"}
PROXY = {"host": "gpu9", "card": "nvml:0", "instance": "10.0.0.9:8081"}


def test_each_exporter_becomes_one_card_with_its_total() -> None:
    result = [
        matrix("DCGM_FI_DEV_FB_USED", DCGM, (100.0, 1000), (101.0, 2000)),
        matrix("DCGM_FI_DEV_FB_FREE", DCGM, (101.0, 79000)),
        matrix("node_drm_memory_vram_used_bytes", NODE, (100.5, 512 * MIB)),
        matrix("node_drm_memory_vram_size_bytes", NODE, (100.5, 16384 * MIB)),
        matrix("spillover_card_used_mib", PROXY, (99.0, 3000), (101.0, 3500)),
        matrix("spillover_card_total_mib", PROXY, (101.0, 81559)),
        matrix("xpum_memory_used_bytes", {"dev_id": "0", "hostname": "arc1"}, (101.0, MIB)),
        matrix("gpu_used_vram", {"gpu_id": "2", "hostname": "mi1"}, (101.0, 100)),
        matrix("gpu_total_vram", {"gpu_id": "2", "hostname": "mi1"}, (101.0, 196592)),
    ]
    cards = cards_of(series_of(result))
    assert set(cards) == {
        "prom:gpu7:1", "prom:10.0.0.8:card0", "prom:gpu9:nvml:0", "prom:arc1:0", "prom:mi1:2",
    }  # fmt: skip
    dcgm = cards["prom:gpu7:1"]
    assert (dcgm.used_mib, dcgm.total_mib, dcgm.time, dcgm.spacing_s) == (2000, 81000, 101, 1)
    assert dcgm.hosts == {"gpu7", "10.0.0.7"} and dcgm.exporter == "dcgm"
    node = cards["prom:10.0.0.8:card0"]
    assert (node.used_mib, node.total_mib, node.spacing_s) == (512, 16384, None)
    assert cards["prom:gpu9:nvml:0"].hosts == {"gpu9", "10.0.0.9"}
    assert cards["prom:gpu9:nvml:0"].spacing_s == 2
    assert cards["prom:arc1:0"].total_mib is None  # XPU Manager gives no total: steps only
    assert (cards["prom:mi1:2"].used_mib, cards["prom:mi1:2"].total_mib) == (100, 196592)


def test_a_total_of_another_target_is_not_joined() -> None:
    other = {**NODE, "instance": "10.0.0.99:9100"}
    result = [
        matrix("node_drm_memory_vram_used_bytes", NODE, (1.0, MIB)),
        matrix("node_drm_memory_vram_size_bytes", other, (1.0, 16384 * MIB)),
    ]
    assert cards_of(series_of(result))["prom:10.0.0.8:card0"].total_mib is None


def test_hosts_come_from_the_labels_in_order() -> None:
    assert host_of({"instance": "[::1]:9100"}) == "::1"
    assert host_of({"instance": "gpu3:9100", "Hostname": "gpu3.lan"}) == "gpu3.lan"
    assert host_of({"instance": "gpu3"}) == "gpu3"
    assert host_of({"job": "x"}) is None
    assert query().startswith('{__name__=~"') and "DCGM_FI_DEV_FB_USED" in query()


def test_selectors_parse_and_match() -> None:
    chosen = parse_selectors(
        'http://10.0.0.2:8080/={Hostname="gpu2", gpu=~"0|1"} http://h:1={instance!="a,b"}'
    )
    assert set(chosen) == {"http://10.0.0.2:8080", "http://h:1"}
    first = chosen["http://10.0.0.2:8080"]
    assert all(m.holds({"Hostname": "gpu2", "gpu": "1"}) for m in first)
    assert not all(m.holds({"Hostname": "gpu2", "gpu": "2"}) for m in first)
    assert chosen["http://h:1"][0].holds({"instance": "c"})
    assert not chosen["http://h:1"][0].holds({"instance": "a,b"})
    for wrong in ("http://x=nope", 'http://x={gpu:"1"}', 'http://x={gpu=~"("}'):
        with pytest.raises(ValueError, match="spillover_remote_cards"):
            parse_selectors(wrong)


class Paced:
    """A source that answers its last reading again until a new one comes, as the
    Prometheus source does between its queries."""

    name = "paced"

    def __init__(self) -> None:
        self.reading: Reading | None = None

    def read(self) -> list[Reading]:
        return [] if self.reading is None else [self.reading]

    def scrape(self, used_mib: float, fresh_s: float = 1.5) -> None:
        self.reading = Reading("prom:h:0", used_mib, 16384, time.monotonic(), fresh_s=fresh_s)


def test_a_remote_step_is_confirmed_by_the_next_scrape_not_by_the_same_one() -> None:
    source, fired = Paced(), []
    monitor = MemoryMonitor([source], fired.append, LINES)
    source.scrape(1000)
    monitor.sample()
    time.sleep(0.3)  # longer than the local step window (0.25 s): scrapes are far apart
    source.scrape(15500)
    for _ in range(5):
        monitor.sample()  # the same reading, again and again: one reading, not five
    assert fired == []
    assert monitor.next_wait == monitor.interval  # no 3 ms confirmation spin for it
    time.sleep(0.3)
    source.scrape(15500)
    monitor.sample()
    (crossing,) = fired
    assert crossing.line.startswith("step +14,500 MiB")


def test_a_remote_reading_goes_stale_by_its_own_bound_and_is_then_unknown() -> None:
    source = Paced()
    monitor = MemoryMonitor([source], lambda _: None, LINES, stale_after=0.05)
    assert monitor.judge({"prom:h:0"}, time.monotonic(), 0) is None  # no source named it
    source.scrape(1000, fresh_s=0.3)
    monitor.sample()
    time.sleep(0.1)  # past the local bound, within its own
    monitor.sample()
    assert monitor.judge({"prom:h:0"}, time.monotonic(), 0) is None
    time.sleep(0.3)
    monitor.sample()
    state, why = monitor.judge({"prom:h:0"}, time.monotonic(), 0)
    assert state == "unknown" and why.startswith("prom:h:0: unknown (stale: no reading for")


def test_unknown_ranks_after_ok_and_before_pressured() -> None:
    servers = [Upstream(f"http://10.0.0.{n}:8080") for n in range(4)]
    states = {servers[1].url: "unknown", servers[2].url: "ok", servers[3].url: "pressured"}
    ladder = Ladder(servers, lambda url: states.get(url, "ok"))
    assert ladder.below() == [2, 1]
    assert ladder.after_failure() == 2

    router = Router()
    judged = {servers[0].url: ("unknown", "no reading"), servers[1].url: ("pressured", "full")}
    judged[servers[2].url] = ("unknown", "no reading")
    router.memory = judged.get
    assert router.plan(servers, lambda _: True) == (servers, None)  # an unknown primary: stays
    judged[servers[0].url] = ("pressured", "full")
    plan, note = router.plan(servers, lambda _: True)
    assert plan[0] == servers[3] and "is pressured (full)" in note  # ok before unknown


def test_the_same_sample_read_again_is_the_same_reading_and_a_failure_is_unknown() -> None:
    """Prometheus's answers stood in for by httpx.MockTransport (the real one is in
    test_fleet.py): what the source makes of an answer repeated, and of none."""
    now = time.time()
    answer = {"status": "success", "data": {"resultType": "matrix", "result": [
        matrix("node_drm_memory_vram_used_bytes", NODE, (now - 1, MIB), (now, 2 * MIB)),
        matrix("node_drm_memory_vram_size_bytes", NODE, (now, 16384 * MIB)),
    ]}}  # fmt: skip
    up = {"ok": True}

    def prometheus(request: httpx.Request) -> httpx.Response:
        assert (
            request.url.path == "/api/v1/query" and request.headers["authorization"] == "Bearer t"
        )
        return httpx.Response(200, json=answer) if up["ok"] else httpx.Response(503)

    source = PrometheusSource("http://prom:9090", "t", 0.25, httpx.MockTransport(prometheus))
    source.poll()
    first = source.read()
    source.poll()
    (again,) = source.read()
    assert [r.time for r in first] == [again.time]  # (its freshness moves with query time)
    assert (again.used_mib, again.total_mib) == (2, 16384)
    assert again.fresh_s == pytest.approx(1.0 * 1.5 + 0.25, abs=0.1)  # 1 s apart, a half, a query
    up["ok"] = False
    source.poll()
    (failed,) = source.read()
    assert isinstance(failed, CardFailure) and failed.card == "prom:10.0.0.8:card0"
    assert failed.error.startswith("prometheus http://prom:9090: HTTPStatusError")
    source.stop()


def test_a_password_in_the_prometheus_url_is_never_shown() -> None:
    source = PrometheusSource("http://user:hunter2@prom:9090/", interval_s=0.25)
    try:
        assert source.status()["url"] == "http://prom:9090"
        source.poll()  # no such host: the error names the server, not the password
        assert "hunter2" not in repr(source.status())
    finally:
        source.stop()


def test_a_fresh_reading_counts_again_once_its_source_answers_again() -> None:
    source = Paced()
    monitor = MemoryMonitor([source], lambda _: None, LINES)
    source.scrape(1000, fresh_s=5)
    monitor.sample()
    kept, source.read = source.read, lambda: [CardFailure("prom:h:0", "prometheus: down")]
    monitor.sample()
    assert monitor.judge({"prom:h:0"}, time.monotonic(), 0) == (
        "unknown", "prom:h:0: unknown (prometheus: down)",
    )  # fmt: skip
    source.read = kept  # answers again, with the same (still fresh) sample
    monitor.sample()
    assert monitor.judge({"prom:h:0"}, time.monotonic(), 0) is None
