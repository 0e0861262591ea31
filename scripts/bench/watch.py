"""Benchmark: how fast the memory monitor sees a step, and what it costs when idle.

Detection: a step (+5,041 MiB, as in the spillover report) is written into a tree of
real sysfs files at a random phase of the sampling; the time from the write to the
handoff decision (the monitor's callback), over many steps. The same step arrives on a
card near its lines (sampled every interval, confirmed 3 ms later) and, with a bigger
step, on a card far from them (sampled ten times less often), and once followed by a
wake-up, as a udev change event does. Idle cost: CPU time of the monitor thread over a
few seconds, on a card far from its lines beside a meminfo file of a 128 GiB machine
(a tree of real files: system RAM is a card too, and on a machine with less than about
26 GiB free it is near its lines and sets the pace), and on a card near them beside
the real /proc/meminfo.

    .venv/bin/python -m scripts.bench.watch [--quick]
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from scripts.testbed.memfiles import FakeCard, write_meminfo
from watchers.meminfo import MeminfoSource
from watchers.monitor import MemoryMonitor
from watchers.pressure import Crossing, Lines
from watchers.reading import Source
from watchers.sysfs import SysfsVramSource

INTERVAL = 0.02


def detection(steps: int, total: int, before: int, after: int, wake: bool) -> list[float]:
    root = Path(tempfile.mkdtemp(prefix="spillover-bench-sysfs-"))
    card = FakeCard(root, "card0", total_mib=total, used_mib=before)
    fired = threading.Event()
    at: list[float] = []

    def on_pressure(crossing: Crossing) -> None:
        at.append(time.perf_counter())
        fired.set()

    monitor = MemoryMonitor([SysfsVramSource(root)], on_pressure, Lines(), INTERVAL).start()
    latencies = []
    rng = random.Random(1)
    try:
        for _ in range(steps):
            card.set_used(before)
            while not monitor.cards.get("drm:card0") or not monitor.cards["drm:card0"].armed:
                time.sleep(INTERVAL / 4)
            time.sleep(0.3 + rng.random() * monitor.next_wait)  # past the window, any phase
            fired.clear()
            written = time.perf_counter()
            card.set_used(after)
            if wake:
                monitor.wake()
            if not fired.wait(2):
                raise RuntimeError("step not detected within 2 s")
            latencies.append((at[-1] - written) * 1000)
    finally:
        monitor.stop()
    return latencies


def idle_cost(seconds: float, total: int, used: int, far_ram: bool) -> tuple[float, float, float]:
    """(CPU percent of one core, microseconds of CPU per sample, sampling interval ms)."""
    root = Path(tempfile.mkdtemp(prefix="spillover-bench-sysfs-"))
    FakeCard(root, "card0", total_mib=total, used_mib=used)
    meminfo = Path("/proc/meminfo")
    if far_ram:
        meminfo = root / "meminfo"
        write_meminfo(meminfo, total_mib=131072, available_mib=120000)
    sources: list[Source] = [SysfsVramSource(root), MeminfoSource(meminfo)]
    monitor = MemoryMonitor(sources, lambda *a: None, Lines(), INTERVAL)
    before = time.process_time()
    monitor.start()
    time.sleep(seconds)
    monitor.stop()
    cpu = time.process_time() - before  # the main thread only sleeps meanwhile
    return cpu / seconds * 100, cpu / monitor.samples * 1e6, monitor.next_wait * 1000


def main() -> None:
    logging.getLogger("watchers").setLevel(logging.ERROR)  # every step logs a warning
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    steps = 30 if args.quick else 200
    print(f"{'step -> handoff decision (ms)':44} {'p50':>7} {'p95':>7} {'max':>7}")
    for label, total, before, after, wake in (
        ("near: 16 GiB card, +5,041 MiB", 16384, 10000, 15041, False),
        ("near, with a udev-style wake-up", 16384, 10000, 15041, True),
        ("far: 141 GiB card, 40 GiB free, +39 GiB", 144384, 103424, 143360, False),
    ):
        samples = sorted(detection(steps, total, before, after, wake))
        p95 = samples[int(len(samples) * 0.95) - 1]
        print(f"{label:44} {statistics.median(samples):7.1f} {p95:7.1f} {samples[-1]:7.1f}")
    seconds = 3 if args.quick else 10
    for label, total, used, far_ram in (
        ("far: 141 GiB card 40 GiB free, 128 GiB RAM", 144384, 103424, True),
        ("near: 16 GiB card 6 GiB free, this RAM", 16384, 10000, False),
    ):
        percent, per_sample, every = idle_cost(seconds, total, used, far_ram)
        print(
            f"idle, {label}: every {every:.0f} ms, "
            f"{percent:.2f}% of one core, {per_sample:.0f} us CPU per sample"
        )


if __name__ == "__main__":
    main()
