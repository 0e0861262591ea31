"""Benchmark: a step on a remote card (read through Prometheus) against a step on a local
one: the time from the write to the first new request that starts on the fallback.

One run, side by side: two primaries on the tiny model, one on this machine with its
card in a sysfs tree the proxy reads, one on 127.0.0.2 (another "host") whose card is a
tree node_exporter's drm collector reads, scraped by Prometheus every SCRAPE_S; each
behind its own proxy (spillover_prometheus asked every QUERY_MS), with one fallback.

    .venv/bin/python -m scripts.bench.fleet
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import httpx

from scripts.bench.routing import percentiles, reroute_times
from scripts.parts.processes import running
from scripts.testbed.fleet import NodeExporter, Prometheus
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.memfiles import FakeCard
from scripts.testbed.mitm import Mitmdump, watch_sysfs
from scripts.testbed.tinymodels import ensure_models

SCRAPE_S = 1.0
QUERY_MS = 250
ROUNDS = 12
CALM, STEP = 10000, 15900


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models = ensure_models(work / "models")
        local_card = FakeCard(work / "local-sys", "card0", total_mib=16384, used_mib=CALM)
        remote_card = FakeCard(work / "remote-sys", "card0", total_mib=16384, used_mib=CALM)
        local = LlamaServer(models["primary"], log_dir=work)
        remote = LlamaServer(models["primary"], log_dir=work, host="127.0.0.2")
        fallback = LlamaServer(models["fallback"], log_dir=work)
        exporter = NodeExporter(work / "remote-sys", host="127.0.0.2", log_dir=work)
        prometheus = Prometheus([f"127.0.0.2:{exporter.port}"], SCRAPE_S, log_dir=work)
        options = ["spillover_dwell_s=1", "spillover_shadow=off"]
        local_proxy = Mitmdump(
            local.url, [fallback.url], log_dir=work,
            options=[*watch_sysfs(work / "local-sys", {local.url: "drm:card0"}), *options],
        )  # fmt: skip
        remote_proxy = Mitmdump(
            remote.url, [fallback.url], log_dir=work,
            options=[
                f"spillover_prometheus={prometheus.url}",
                f"spillover_prometheus_interval_ms={QUERY_MS}", *options,
            ],
        )  # fmt: skip
        with running(local, remote, fallback, exporter, prometheus, local_proxy, remote_proxy):
            for proxy in (local_proxy, remote_proxy):
                proxy.servers_known()
            wait_for_remote_card(remote_proxy)
            near = reroute_times(local_proxy, local.url, local_card, CALM, STEP, ROUNDS)
            # Stepped anywhere within a scrape interval: not in step with the scrapes.
            far = reroute_times(remote_proxy, remote.url, remote_card, CALM, STEP, ROUNDS, SCRAPE_S)
    print(f"step -> first new request on the fallback ({ROUNDS} steps each, ms)")
    print(f"  local card (sysfs, 20 ms sampling):            {percentiles(near)}")
    print(
        f"  remote card (node_exporter -> Prometheus every {SCRAPE_S:g} s, asked every "
        f"{QUERY_MS} ms): {percentiles(far)}"
    )
    print(f"  remote / local (p50): {statistics.median(far) / statistics.median(near):.0f}x")


def wait_for_remote_card(proxy: Mitmdump) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        memory = httpx.get(f"{proxy.url}/spillover/status").json()["memory"]
        if any(card.startswith("prom:") for card in memory["cards"]):
            return
        time.sleep(0.1)
    raise RuntimeError(f"no remote card seen: {memory.get('prometheus')}")


if __name__ == "__main__":
    main()
