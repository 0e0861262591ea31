"""The manual's table of what fires when, on 8 to 141 GiB cards, checked cell by cell
against the watcher's own code (CardState and the monitor's sampling pace)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scripts.testbed.memfiles import FakeCard
from watchers.monitor import SLOW_FACTOR, MemoryMonitor
from watchers.pressure import CardState, Lines
from watchers.reading import Reading
from watchers.sysfs import SysfsVramSource

MANUAL = Path(__file__).resolve().parent.parent / "docs" / "memory.md"
LINES = Lines()
STEP = 0.02  # seconds between readings, as the monitor samples near a line


def table() -> list[list[str]]:
    text = MANUAL.read_text()
    start = text.index("| card | hands off at free <=")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def mib(cell: str) -> float | None:
    """'2,560 MiB' -> 2560; 'always' -> None."""
    if cell.startswith("always"):
        return None
    return float(re.match(r"([\d,]+) MiB", cell).group(1).replace(",", ""))


def fires(total: float, used: list[float], rest_used: float | None = None) -> bool:
    """Whether these readings fire a card that was at rest with `rest_used` (half of it,
    unless said) two seconds before them (past late_s: only they can make a step)."""
    state = CardState("c")
    rest = [total / 2 if rest_used is None else rest_used] * 3
    readings = [(i * STEP, u) for i, u in enumerate(rest)]
    readings += [(2 + i * STEP, u) for i, u in enumerate(used)]
    return any(state.observe(Reading("c", u, total, t), LINES) is not None for t, u in readings)


def step_fires(total: float, rise: float, leaves: float) -> bool:
    before = total - leaves - rise
    return fires(total, [before] * 3 + [before + rise] * 2, rest_used=before)


def rearms_at(total: float, free: float, rest_free: float | None = None) -> bool:
    state = CardState("c")
    rest = total / 2 if rest_free is None else rest_free
    floor = LINES.acts_at(total, rest)
    readings = [total - rest] * 3 + [total - floor] * 2 + [total - free] * 20  # fire, settle
    for i, used in enumerate(readings):
        state.observe(Reading("c", used, total, i * STEP), LINES)
    return state.fired == 1 and state.armed


def fast_at(tmp_path: Path, total: int, free: int) -> bool:
    sysfs = tmp_path / f"free-{free}"
    FakeCard(sysfs, "card0", total_mib=total, used_mib=total - free)
    monitor = MemoryMonitor([SysfsVramSource(sysfs)], lambda *a: None, LINES, interval=STEP)
    monitor.sample()
    assert monitor.next_wait in (STEP, STEP * SLOW_FACTOR)
    return monitor.next_wait == STEP


def test_the_table_has_the_card_sizes_the_issue_names() -> None:
    assert [row[0] for row in table()] == ["8 GiB", "24 GiB", "80 GiB", "141 GiB"]


@pytest.mark.parametrize("row", table(), ids=lambda row: row[0])
def test_each_cell_is_what_the_watcher_does(row: list[str], tmp_path: Path) -> None:
    total = float(row[0].split()[0]) * 1024
    floor, one_gib, five_gib, clear, fast = (mib(cell) for cell in row[1:])
    assert floor is not None and one_gib is not None and clear is not None
    # The floor: at it, fired; one MiB above it, not.
    assert fires(total, [total - floor] * 2)
    assert not fires(total, [total - floor - 1] * 2)
    # Steps: leaving exactly the cell, fired; one MiB more, not (unless "always").
    assert step_fires(total, 1024, one_gib) and not step_fires(total, 1024, one_gib + 1)
    assert five_gib is not None
    assert step_fires(total, 5120, min(five_gib, total - 5120))
    if "always" in row[3]:
        assert five_gib + 5120 >= total
    else:
        assert not step_fires(total, 5120, five_gib + 1)
    # Clear again: at the cell, re-armed; one MiB less, still pressed.
    assert rearms_at(total, clear) and not rearms_at(total, clear - 1)
    # Sampling pace.
    if fast is None:
        assert fast_at(tmp_path, int(total), int(total) - 1)  # even an empty card
    else:
        assert fast_at(tmp_path, int(total), int(fast))
        assert not fast_at(tmp_path, int(total), int(fast) + 1)


def full_table() -> list[list[str]]:
    text = MANUAL.read_text()
    start = text.index("| card | free at rest | hands off at free <=")
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in text[start:].splitlines()[2:]
        if line.startswith("|")
    ][:3]


@pytest.mark.parametrize("row", full_table(), ids=lambda row: f"{row[0]} at {row[1]}")
def test_a_card_full_at_rest_acts_as_the_manual_says(row: list[str]) -> None:
    total = float(row[0].split()[0].replace(",", "")) * (1024 if "GiB" in row[0] else 1)
    rest, floor, clear = (mib(cell) for cell in row[1:4])
    assert rest is not None and floor is not None and clear is not None
    assert not fires(total, [total - rest] * 50, rest_used=total - rest)  # dead flat: never
    assert fires(total, [total - floor] * 2, rest_used=total - rest)
    assert not fires(total, [total - floor - 1] * 2, rest_used=total - rest)
    assert rearms_at(total, clear, rest) and not rearms_at(total, clear - 1, rest)
