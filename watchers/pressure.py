"""When a card is under pressure: the lines, and per-card state with hysteresis.

Pressure arrives as a step (another process loads and takes gigabytes at once), not as
a creep: llama-server preallocates its KV cache. The lines are in MiB of free memory, not
percentages (5 % of an 8 GiB card is 410 MiB; of a 141 GiB card, 7 GiB):

- the floor: free memory at or below `floor(total)`: 3 % of the card, at least 512 MiB,
  at most 2 GiB (or `free_floor_mib` on every card);
- a step: use rose by at least `step_mib` within `window_s` and what is left is at most
  the floor plus twice the rise: two more steps like it would reach the floor.

A line must hold on two readings in a row (the monitor takes the second a few ms after
the first), so one noisy reading never fires; a card that fired re-arms once it has
`rearm_mib` more than its floor free and no step is under way.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from watchers.reading import Reading

FLOOR_SHARE = 0.03
FLOOR_MIN_MIB = 512.0
FLOOR_MAX_MIB = 2048.0


@dataclass(frozen=True)
class Lines:
    free_floor_mib: float = 0  # 0: by the card's size (FLOOR_SHARE, within MIN..MAX)
    step_mib: float = 1024
    rearm_mib: float = 1024
    window_s: float = 0.25

    def floor(self, total_mib: float | None) -> float:
        if self.free_floor_mib > 0:
            return self.free_floor_mib
        if total_mib is None:
            return FLOOR_MIN_MIB
        return min(max(total_mib * FLOOR_SHARE, FLOOR_MIN_MIB), FLOOR_MAX_MIB)

    def step_leaves(self, rise_mib: float, total_mib: float | None) -> float:
        """A step of `rise_mib` fires when it leaves at most this much free."""
        return self.floor(total_mib) + 2 * rise_mib

    def margin(self, reading: Reading) -> float | None:
        """The smallest sudden allocation that would fire on this card now (None: any
        step, as the card's total is unknown). The monitor samples faster when it is small."""
        if reading.free_mib is None:
            return None
        room = max(reading.free_mib - self.floor(reading.total_mib), 0.0)
        return min(room, max(self.step_mib, room / 3))


@dataclass(frozen=True)
class Crossing:
    """A confirmed crossing, with the times that bound when the memory was taken."""

    card: str
    line: str  # which line, in words
    crossed: float  # the reading that first crossed it (time.monotonic())
    confirmed: float  # the reading that confirmed it
    last_below: float | None  # the last reading under every line before it: the memory
    # was taken after this one


@dataclass
class CardState:
    card: str
    last: Reading | None = None
    error: str | None = None
    armed: bool = True
    fired: int = 0
    fired_for: str | None = None  # the line it last fired on
    clear_since: float | None = None  # when it was last re-armed (reading time)
    suspect: Reading | None = None  # a reading over a line, awaiting confirmation
    below: float | None = None  # the time of the last reading under every line
    history: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=64))

    def crossed(self, reading: Reading, lines: Lines) -> str | None:
        """Which line the reading crosses, if any."""
        free, floor = reading.free_mib, lines.floor(reading.total_mib)
        if free is not None and free <= floor:
            return f"{free:,.0f} MiB free (floor {floor:,.0f})"
        # Readings far apart (a remote card's scrapes): the rise between the last ones.
        window = max(lines.window_s, 2 * (reading.fresh_s or 0.0))
        recent = [used for t, used in self.history if reading.time - t <= window]
        if recent:
            rise = reading.used_mib - min(recent)
            if rise >= lines.step_mib and (
                free is None or free <= lines.step_leaves(rise, reading.total_mib)
            ):
                left = "" if free is None else f", {free:,.0f} MiB left"
                return f"step +{rise:,.0f} MiB{left}"
        return None

    def clear(self, reading: Reading, lines: Lines) -> bool:
        free = reading.free_mib
        room = free is None or free >= lines.floor(reading.total_mib) + lines.rearm_mib
        return room and self.crossed(reading, lines) is None

    def observe(self, reading: Reading, lines: Lines) -> Crossing | None:
        """Take a reading; the crossing when this card must hand off now, else None."""
        self.error = None
        line = self.crossed(reading, lines)
        self.last = reading
        if line is None:
            self.below = reading.time
        if not self.armed:
            if self.clear(reading, lines):
                self.armed = True
                self.clear_since = reading.time
            self.suspect = None
        elif line is None:
            self.suspect = None
        elif self.suspect is None:
            self.suspect = reading
            return None  # keep the baseline: the next reading confirms against it
        else:
            crossing = Crossing(self.card, line, self.suspect.time, reading.time, self.below)
            self.suspect = None
            self.armed = False
            self.fired += 1
            self.fired_for = line
            self.history.append((reading.time, reading.used_mib))
            return crossing
        self.history.append((reading.time, reading.used_mib))
        return None

    def within(self, lines: Lines, margin_mib: float) -> bool:
        """Whether a sudden allocation of at most `margin_mib` would cross a line (or the
        card's total is unknown, so any step could); needs a reading."""
        assert self.last is not None
        margin = lines.margin(self.last)
        return margin is None or margin <= margin_mib

    def pressed(self, now: float, dwell_s: float) -> str | None:
        """Why the card is not yet fit for new work: over a line (fired, not re-armed),
        or re-armed less than `dwell_s` ago. None when it is clear."""
        if not self.armed:
            return f"{self.card}: {self.fired_for or 'over a line'}"
        if self.clear_since is not None and now - self.clear_since < dwell_s:
            return f"{self.card}: clear for {now - self.clear_since:.1f} s of {dwell_s:g}"
        return None

    def unknown(self) -> str | None:
        """Why nothing can be said of the card now (its reading failed or is stale)."""
        return None if self.error is None else f"{self.card}: unknown ({self.error})"

    def fail(self, error: str) -> None:
        """A failed or stale reading: reported, and never part of a decision."""
        self.error = error
        self.suspect = None
