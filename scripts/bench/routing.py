"""Benchmark: how fast new requests avoid a card under pressure, and what routing costs.

Part 1, real processes: two llama-servers on the tiny models behind mitmdump with the
addon, the primary on card0 of a sysfs tree of real files. A client sends small whole
answers back to back; card0 is stepped past its lines at a random moment; the time from
the write to the first answer that started on the fallback (its `x-spillover-route`
header) is measured, 20 times (the card is cleared and the dwell waited out in between).
Part 2, in-process: the time `Router.plan` takes to choose where a request starts, with
every server ok and with the primary pressured.

    .venv/bin/python -m scripts.bench.routing
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
import timeit
from pathlib import Path

import httpx

from addon.servers.routing import Router
from addon.servers.upstream import Upstream
from scripts.parts.processes import running
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.memfiles import FakeCard
from scripts.testbed.mitm import Mitmdump, watch_sysfs
from scripts.testbed.prompts import chat_body
from scripts.testbed.tinymodels import ensure_models
from watchers.gates import CardMap
from watchers.monitor import MemoryMonitor
from watchers.pressure import CardState

ROUNDS = 20


def step_to_reroute(work: Path) -> list[float]:
    models = ensure_models(work / "models")
    sysfs = work / "sys"
    card0 = FakeCard(sysfs, "card0", total_mib=16384, used_mib=10000)
    FakeCard(sysfs, "card1", total_mib=8192, used_mib=2000)
    primary = LlamaServer(models["primary"], log_dir=work)
    fallback = LlamaServer(models["fallback"], log_dir=work)
    on = {primary.url: "drm:card0", fallback.url: "drm:card1"}
    options = [*watch_sysfs(sysfs, on), "spillover_dwell_s=1"]
    proxy = Mitmdump(primary.url, [fallback.url], options=options, log_dir=work)
    with running(primary, fallback, proxy):
        proxy.servers_known()
        return reroute_times(proxy, primary.url, card0, calm_mib=10000, step_mib=15900)


def reroute_times(
    proxy: Mitmdump,
    primary: str,
    card: FakeCard,
    calm_mib: int,
    step_mib: int,
    rounds: int = ROUNDS,
    spread_s: float = 0.2,
) -> list[float]:
    """A client sends small whole answers back to back; `card` is stepped at a random
    moment (within `spread_s`); ms from the write to the first answer that started
    elsewhere (its `x-spillover-route` header), `rounds` times (cleared, dwell waited
    out, between)."""
    body = {**chat_body(1), "stream": False}
    times: list[float] = []
    rng = random.Random(0)
    with httpx.Client(timeout=30) as client:
        for _ in range(rounds):
            stepped = None
            step_after = time.monotonic() + rng.uniform(0.05, 0.05 + spread_s)
            while True:
                reply = client.post(f"{proxy.url}/v1/chat/completions", json=body)
                if stepped is None and time.monotonic() >= step_after:
                    card.set_used(step_mib)
                    stepped = time.monotonic()
                elif stepped is not None and "x-spillover-route" in reply.headers:
                    times.append((time.monotonic() - stepped) * 1000)
                    break
            card.set_used(calm_mib)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the dwell, and the primary is ok again
                states = client.get(f"{proxy.url}/spillover/status").json()["routing"]
                if states["states"][primary]["state"] == "ok":
                    break
                time.sleep(0.05)
    return times


def percentiles(times: list[float]) -> str:
    times = sorted(times)
    p95 = times[max(int(len(times) * 0.95) - 1, 0)]
    return f"p50 {statistics.median(times):.1f}  p95 {p95:.1f}  max {times[-1]:.1f}"


def decision_cost() -> tuple[float, float]:
    """Microseconds per routing decision as the addon makes it: the router asks the
    memory monitor about each server's cards (through the card map) until one is ok."""
    ladder = [Upstream(f"http://127.0.0.1:{8081 + i}") for i in range(3)]
    cards = CardMap({u.url: {f"drm:card{i}"} for i, u in enumerate(ladder)}, dict, Path("/"))
    monitor = MemoryMonitor([], lambda *_: None)
    for i in range(3):
        monitor.cards[f"drm:card{i}"] = CardState(f"drm:card{i}")
    router = Router()
    router.memory = lambda url: monitor.judge(cards.cards_of(url), time.monotonic(), 30)

    def cost() -> float:
        runs = timeit.repeat(lambda: router.plan(ladder, lambda _: True), number=10000, repeat=5)
        return min(runs) / 10000 * 1e6

    ok = cost()
    monitor.cards["drm:card0"].armed = False  # the primary's card fired
    return ok, cost()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        times = step_to_reroute(Path(tmp))
    print(f"pressure step -> first new request on the fallback ({len(times)} steps, ms):")
    print(f"  {percentiles(times)}")
    ok, pressed = decision_cost()
    print(f"routing decision (Router.plan): {ok:.2f} us all ok, {pressed:.2f} us primary pressured")


if __name__ == "__main__":
    main()
