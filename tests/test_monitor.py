"""The monitor thread on real files: it hands off on a step written to a sysfs tree,
never holds up the event loop's questions while a read stalls, survives a failing
source, never fires on stale readings, and samples fast only near a line."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from scripts.testbed.memfiles import FakeCard, write_meminfo
from tests.test_watchers import LINES
from watchers.meminfo import MeminfoSource
from watchers.monitor import CONFIRM_S, SLOW_FACTOR, MemoryMonitor
from watchers.pressure import Crossing
from watchers.reading import CardFailure, Reading
from watchers.sysfs import SysfsVramSource


def test_monitor_hands_off_on_a_step_written_to_the_tree(tmp_path: Path) -> None:
    card = FakeCard(tmp_path, "card0", total_mib=16384, used_mib=10000)
    fired = []
    done = threading.Event()
    monitor = MemoryMonitor(
        [SysfsVramSource(tmp_path)],
        lambda c: (fired.append((c.card, c.line, time.monotonic())), done.set()),
        LINES,
    ).start()
    try:
        time.sleep(0.1)
        written = time.monotonic()
        card.set_used(15041)
        assert done.wait(2)
        (card_id, why, at) = fired[0]
        assert card_id == "drm:card0" and "step" in why
        assert at - written < 0.5
        status = monitor.status()
        assert status["cards"]["drm:card0"]["fired"] == 1 and status["alive"]
    finally:
        monitor.stop()


def test_a_slow_source_never_holds_up_what_the_event_loop_asks(tmp_path: Path) -> None:
    """A driver call that hangs (NVML while a GPU falls off the bus), or a walk of /proc
    for the servers' processes once who holds a card's memory has moved: while the
    monitor thread waits on either, the event loop's questions (routing's judge, each
    live answer's near, the status) are answered from the last readings at once. A real
    sysfs tree, read through a source that waits first or names a new holder each time:
    no real driver hangs, and no process list moves, on demand."""
    FakeCard(tmp_path, "card0", total_mib=16384, used_mib=10000)
    sysfs = SysfsVramSource(tmp_path)
    slow_read, slow_owners, waiting = threading.Event(), threading.Event(), threading.Event()
    holder = iter(range(1000, 2000))

    class Stalling:
        name = "stalling"

        def read(self) -> list[Reading | CardFailure]:
            if slow_read.is_set():
                waiting.set()
                time.sleep(1.0)
            (found,) = sysfs.read()
            assert isinstance(found, Reading)
            return [replace(found, held=((next(holder), 100.0),))]

    def own_pids() -> set[int]:
        if slow_owners.is_set():
            waiting.set()
            time.sleep(1.0)
        return set()

    monitor = MemoryMonitor([Stalling()], lambda *a: None, LINES, own_pids=own_pids).start()
    try:
        for slow in (slow_read, slow_owners):
            time.sleep(0.1)
            waiting.clear()
            slow.set()
            assert waiting.wait(2)
            asked = time.monotonic()
            assert monitor.judge({"drm:card0"}, time.monotonic(), 0) is None
            assert not monitor.near({"drm:card0"}, 1024)
            assert monitor.status()["cards"]["drm:card0"]["used_mib"] == 10000
            assert time.monotonic() - asked < 0.2, slow is slow_read
            slow.clear()
    finally:
        monitor.stop()


def test_monitor_survives_a_failing_source_and_reports_it(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    write_meminfo(meminfo, total_mib=1000, available_mib=10)  # would be pressure
    source = MeminfoSource(meminfo)
    meminfo.write_text("garbage")
    fired = []
    monitor = MemoryMonitor([source], lambda *a: fired.append(a), LINES).start()
    try:
        time.sleep(0.2)
        assert monitor.alive and fired == []
        assert "meminfo" in monitor.status()["source_errors"]
    finally:
        monitor.stop()


def test_stale_readings_never_fire(tmp_path: Path) -> None:
    class Frozen:
        name = "frozen"

        def read(self) -> list[Reading]:
            return [Reading("c", 15900, 16384, 0.0)]  # the same old reading every time

    fired = []
    monitor = MemoryMonitor([Frozen()], lambda *a: fired.append(a), LINES, stale_after=0.5)
    for _ in range(3):
        monitor.sample()
    assert fired == [] and "stale" in monitor.status()["cards"]["c"]["error"]


def test_the_monitor_samples_fast_only_near_a_line(tmp_path: Path) -> None:
    card = FakeCard(tmp_path, "card0", total_mib=81920, used_mib=10000)

    def first_wait(used_mib: int) -> MemoryMonitor:
        card.set_used(used_mib)
        monitor = MemoryMonitor([SysfsVramSource(tmp_path)], lambda *a: None, LINES, 0.02)
        monitor.sample()
        return monitor

    assert first_wait(10000).next_wait == pytest.approx(0.02 * SLOW_FACTOR)  # 70 GiB free
    monitor = first_wait(60000)  # 21 GiB free: a sudden 6.4 GiB would fire
    assert monitor.next_wait == pytest.approx(0.02)
    card.set_used(80000)  # under the floor: confirmed a few ms later, not an interval later
    monitor.sample()
    assert monitor.next_wait == CONFIRM_S
    monitor.sample()
    assert monitor.cards["drm:card0"].fired == 1


def test_a_step_between_two_readings_at_the_slowest_pace_fires(tmp_path: Path) -> None:
    """spillover_interval_ms=100: every card far from its lines is read once a second,
    past the step window and the default late bound. A step between two such readings
    (60 GiB taken from an 80 GiB card with 70 free) is still a step."""
    card = FakeCard(tmp_path, "card0", total_mib=81920, used_mib=10000)
    fired: list[Crossing] = []
    monitor = MemoryMonitor([SysfsVramSource(tmp_path)], fired.append, LINES, interval=0.1)
    monitor.sample()
    assert monitor.next_wait == pytest.approx(0.1 * SLOW_FACTOR)
    time.sleep(1.1)  # that pace, and a little late
    card.set_used(70000)
    monitor.sample()
    monitor.sample()
    (crossing,) = fired
    assert "step +60,000 MiB" in crossing.line
