"""When a card is under pressure: the lines, and per-card state with hysteresis.

Pressure is memory taken from a card's servers, not a level. People size a model to fill
its card (a few hundred MiB free at rest is normal), and what kills an answer is another
process loading onto it: a step (the report this project started from: +5,041 MiB at
once, the card otherwise dead flat). So each card keeps its free memory at rest (the
most it had free since it was first read, or since a server on it came up), and the
lines are in MiB of free memory, measured against that:

- the floor: free memory at or below 3 % of the card, at least 512 MiB, at most 2 GiB;
  a card that had less than twice that free at rest acts once half of what it had free
  is gone instead (`free_floor_mib` sets one floor for every card, kept as it is for a
  card that had more than it free at rest);
- a step: use rose by at least `step_mib` within `window_s` and what is left is at most
  the floor plus twice the rise: two more steps like it would reach the floor.

A line must hold on two readings in a row (the monitor takes the second a few ms after
the first), so one noisy reading never fires; a card that fired re-arms once it has
`rearm_mib` more than its floor free, or has three quarters of what was taken back
(whichever comes first), and no step is under way.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from watchers.reading import Reading

FLOOR_SHARE = 0.03
FLOOR_MIN_MIB = 512.0
FLOOR_MAX_MIB = 2048.0
REST_SHARE = 0.5  # a card full at rest acts when this share of its free memory is taken
BACK_SHARE = 0.75  # ... and is clear again once this share of what was taken is back


@dataclass(frozen=True)
class Lines:
    free_floor_mib: float = 0  # 0: by the card's size (FLOOR_SHARE, within MIN..MAX)
    step_mib: float = 1024
    rearm_mib: float = 1024
    window_s: float = 0.25

    def floor(self, total_mib: float | None) -> float:
        """The floor for a card of this size, as configured."""
        if self.free_floor_mib > 0:
            return self.free_floor_mib
        if total_mib is None:
            return FLOOR_MIN_MIB
        return min(max(total_mib * FLOOR_SHARE, FLOOR_MIN_MIB), FLOOR_MAX_MIB)

    def acts_at(self, total_mib: float | None, rest_free_mib: float | None) -> float:
        """The free memory this card hands off at: its floor, or, for a card that had
        less than twice that free at rest, half of what it had. A floor set by hand is
        kept for any card that had more than it free at rest."""
        floor = self.floor(total_mib)
        if rest_free_mib is None or (self.free_floor_mib > 0 and rest_free_mib > floor):
            return floor
        return min(floor, max(rest_free_mib, 0.0) * REST_SHARE)

    def clear_at(self, total_mib: float | None, rest_free_mib: float | None) -> float:
        """The free memory at which a card that fired is clear again."""
        acts = self.acts_at(total_mib, rest_free_mib)
        if rest_free_mib is None or rest_free_mib <= acts:
            return acts + self.rearm_mib
        return min(acts + self.rearm_mib, acts + BACK_SHARE * (rest_free_mib - acts))

    def step_leaves(
        self, rise_mib: float, total_mib: float | None, rest_free_mib: float | None = None
    ) -> float:
        """A step of `rise_mib` fires when it leaves at most this much free."""
        return self.acts_at(total_mib, rest_free_mib) + 2 * rise_mib

    def margin(self, reading: Reading, rest_free_mib: float | None = None) -> float | None:
        """The smallest sudden allocation that would fire on this card now (None: any
        step, as the card's total is unknown). The monitor samples faster when it is small."""
        if reading.free_mib is None:
            return None
        room = max(reading.free_mib - self.acts_at(reading.total_mib, rest_free_mib), 0.0)
        return min(room, max(self.step_mib, room / 3))

    def acts_on(self, total_mib: float | None, rest_free_mib: float | None) -> str:
        """What this card hands off on, in words (the start-up log, status, the doctor)."""
        step = f"a step of +{self.step_mib:,.0f} MiB"
        if total_mib is None:
            return f"{step} (total unknown: steps only)"
        acts = self.acts_at(total_mib, rest_free_mib)
        said = f"free <= {acts:,.0f} MiB or {step} leaving <= {acts + 2 * self.step_mib:,.0f}"
        if acts < self.floor(total_mib):
            under = "under its" if self.free_floor_mib > 0 else "under twice its"
            said += (
                f" (full at rest: {rest_free_mib:,.0f} MiB free, {under} "
                f"{self.floor(total_mib):,.0f} MiB floor, so half of that taken)"
            )
        return said


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
    fired_at: float | None = None  # the reading it last fired on (time.monotonic())
    clear_since: float | None = None  # when it was last re-armed (reading time)
    suspect: Reading | None = None  # a reading over a line, awaiting confirmation
    below: float | None = None  # the time of the last reading under every line
    rest_free: float | None = None  # the most it had free since first read or settled
    history: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=64))

    def crossed(self, reading: Reading, lines: Lines) -> str | None:
        """Which line the reading crosses, if any."""
        free, floor = reading.free_mib, lines.acts_at(reading.total_mib, self.rest_free)
        if free is not None and free <= floor:
            return f"{free:,.0f} MiB free (floor {floor:,.0f})"
        # Readings far apart (a remote card's scrapes): the rise between the last ones.
        window = max(lines.window_s, 2 * (reading.fresh_s or 0.0))
        recent = [used for t, used in self.history if reading.time - t <= window]
        if recent:
            rise = reading.used_mib - min(recent)
            if rise >= lines.step_mib and (
                free is None or free <= lines.step_leaves(rise, reading.total_mib, self.rest_free)
            ):
                left = "" if free is None else f", {free:,.0f} MiB left"
                return f"step +{rise:,.0f} MiB{left}"
        return None

    def clear(self, reading: Reading, lines: Lines) -> bool:
        free = reading.free_mib
        room = free is None or free >= lines.clear_at(reading.total_mib, self.rest_free)
        return room and self.crossed(reading, lines) is None

    def observe(self, reading: Reading, lines: Lines) -> Crossing | None:
        """Take a reading; the crossing when this card must hand off now, else None."""
        self.error = None
        if reading.free_mib is not None:
            self.rest_free = max(self.rest_free or 0.0, reading.free_mib)
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
            self.fired_at = reading.time
            self.history.append((reading.time, reading.used_mib))
            return crossing
        self.history.append((reading.time, reading.used_mib))
        return None

    def within(self, lines: Lines, margin_mib: float) -> bool:
        """Whether a sudden allocation of at most `margin_mib` would cross a line (or the
        card's total is unknown, so any step could); needs a reading."""
        assert self.last is not None
        margin = lines.margin(self.last, self.rest_free)
        return margin is None or margin <= margin_mib

    def settle(self, since: float) -> bool:
        """A server on this card came up after being down from `since`: what the card has
        free now is its rest, and if it fired since then (the server loading its model
        filled it) it is clear at once; pressure from before the server went down stays.
        Whether anything changed."""
        if self.last is None or self.last.free_mib is None:
            return False
        if not self.armed and (self.fired_at is None or self.fired_at < since):
            return False
        changed = not self.armed or self.rest_free != self.last.free_mib
        self.rest_free = self.last.free_mib
        self.armed, self.suspect, self.clear_since = True, None, None
        self.history.clear()
        self.history.append((self.last.time, self.last.used_mib))
        return changed

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
