"""Benchmark: how fast the memory monitor sees a step, and what it costs when idle.

Detection latency: a step (+5,041 MiB, as in the spillover report) is written into a
tree of real sysfs files; the time from the write to the handoff decision, over many
steps, at random phases of the sampling interval. Once with plain polling, once with the
write followed by a wake-up, as a udev change event does. Idle cost: CPU time of the
monitor thread over a few seconds with the sysfs and the real /proc/meminfo sources.

    .venv/bin/python -m scripts.bench_watch [--quick]
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

from scripts.memfiles import FakeCard
from watchers.meminfo import MeminfoSource
from watchers.monitor import MemoryMonitor
from watchers.pressure import Lines
from watchers.sysfs import SysfsVramSource


def detection(steps: int, wake: bool, interval: float) -> list[float]:
    root = Path(tempfile.mkdtemp(prefix="spillover-bench-sysfs-"))
    card = FakeCard(root, "card0", total_mib=16384, used_mib=10000)
    fired = threading.Event()
    at: list[float] = []
    monitor = MemoryMonitor(
        [SysfsVramSource(root)],
        lambda card, why: (at.append(time.perf_counter()), fired.set()),
        Lines(),
        interval=interval,
    ).start()
    latencies = []
    rng = random.Random(1)
    try:
        for _ in range(steps):
            card.set_used(10000)
            while not monitor.cards.get("drm:card0") or not monitor.cards["drm:card0"].armed:
                time.sleep(interval / 4)
            time.sleep(interval * 3 + rng.random() * interval)  # a random phase
            fired.clear()
            written = time.perf_counter()
            card.set_used(15041)
            if wake:
                monitor.wake()
            if not fired.wait(2):
                raise RuntimeError("step not detected within 2 s")
            latencies.append((at[-1] - written) * 1000)
    finally:
        monitor.stop()
    return latencies


def idle_cost(seconds: float) -> tuple[float, float]:
    """(CPU percent of one core, microseconds of CPU per sample)."""
    root = Path(tempfile.mkdtemp(prefix="spillover-bench-sysfs-"))
    FakeCard(root, "card0", total_mib=16384, used_mib=10000)
    monitor = MemoryMonitor([SysfsVramSource(root), MeminfoSource()], lambda *a: None)
    before = time.process_time()
    monitor.start()
    time.sleep(seconds)
    monitor.stop()
    cpu = time.process_time() - before  # the main thread only sleeps meanwhile
    return cpu / seconds * 100, cpu / monitor.samples * 1e6


def main() -> None:
    logging.getLogger("watchers").setLevel(logging.ERROR)  # every step logs a warning
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    steps = 30 if args.quick else 200
    print(f"{'detection (ms)':32} {'p50':>7} {'p95':>7} {'max':>7}")
    for label, wake, interval in (
        ("polling every 20 ms", False, 0.02),
        ("polling every 10 ms", False, 0.01),
        ("20 ms + udev-style wake-up", True, 0.02),
    ):
        samples = sorted(detection(steps, wake, interval))
        p50 = statistics.median(samples)
        p95 = samples[int(len(samples) * 0.95) - 1]
        print(f"{label:32} {p50:7.1f} {p95:7.1f} {samples[-1]:7.1f}")
    percent, per_sample = idle_cost(3 if args.quick else 10)
    print(
        f"idle monitor (sysfs + /proc/meminfo, 20 ms): {percent:.2f}% of one core, "
        f"{per_sample:.0f} us CPU per sample"
    )


if __name__ == "__main__":
    main()
