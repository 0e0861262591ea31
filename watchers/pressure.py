"""When a card is under pressure: the lines, and per-card state with hysteresis.

Pressure is memory taken from a card's servers, not a level. People size a model to fill
its card (a few hundred MiB free at rest is normal), and what kills an answer is another
process loading onto it: a step (the report this project started from: +5,041 MiB at
once, the card otherwise dead flat). So each card keeps its free memory at rest, and the
lines are in MiB of free memory, measured against that:

- the floor: free memory at or below 3 % of the card, at least 512 MiB, at most 2 GiB;
  a card that had less than twice that free at rest acts once half of what it had free
  is gone instead (`free_floor_mib` sets one floor for every card, kept as it is for a
  card that had more than it free at rest);
- a step: use rose by at least `step_mib` within `window_s` and what is left is at most
  the floor plus twice the rise: two more steps like it would reach the floor.

The rest is what the card had free when first read, raised at once when memory comes
back, and moved to where the card's memory has held still (within a quarter of a step)
for `settle_s`: memory another program keeps, or a model reloaded behind an open port,
is the card's new rest rather than pressure for good. What the card's own servers hold,
where the source tells (NVML's process list, DRM fdinfo), moves the rest with it, so
their growing or reloading never fires. A server coming up after loading settles its
card at once.

A line must hold on two readings in a row (the monitor takes the second a few ms after
the first), so one noisy reading never fires. A monitor that fell behind (readings
further apart than `window_s`, up to `late_s`) measures a step from the reading before.
While pressured, the lines count from what the card had free when it fired, so each
further step fires again. A card that fired
re-arms once it has `rearm_mib` more than its floor free, or three quarters of what was
taken back (whichever comes first), and no step is under way; or once its memory has held
still for `settle_s` (that level is then its rest).
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
    settle_s: float = 30.0  # memory held still this long is the card's new rest
    # A late monitor's reading before still measures a step this far back (the monitor
    # stretches it past its own slowest pace: see MemoryMonitor).
    late_s: float = 1.0

    @property
    def still_mib(self) -> float:
        """How far a card's level may wander and still count as holding still."""
        return self.step_mib / 4

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
class Stillness:
    """How long a card's level (the memory others hold on it) has stayed within a band."""

    since: float | None = None
    low: float = 0.0
    high: float = 0.0

    def update(self, at: float, level: float, band_mib: float) -> None:
        low, high = min(self.low, level), max(self.high, level)
        if self.since is None or high - low > band_mib:
            self.since, self.low, self.high = at, level, level
        else:
            self.low, self.high = low, high

    def held(self, now: float) -> float:
        return 0.0 if self.since is None else now - self.since

    def restart(self) -> None:
        self.since = None


@dataclass
class CardState:
    card: str
    last: Reading | None = None
    error: str | None = None
    armed: bool = True
    fired: int = 0
    fired_for: str | None = None  # the line it last fired on
    fired_at: float | None = None  # the reading it last fired on (time.monotonic())
    clear_since: float | None = None  # when it was last re-armed by memory coming back
    suspect: Reading | None = None  # a reading over a line, awaiting confirmation
    below: float | None = None  # the time of the last reading under every line
    rest_free: float | None = None  # what it has free at rest (see the module's doc)
    rest_since: float | None = None  # the reading that rest was taken at
    rest_how: str = ""  # why that is its rest, in words
    # While pressured: what it had free when it last fired. Its lines count from there,
    # so a further step fires again.
    pressed_free: float | None = None
    # What the card's own servers hold on it, where the source tells (None: not known);
    # their growing, shrinking or reloading moves the rest with it and is never a step.
    own_mib: float | None = None
    still: Stillness = field(default_factory=Stillness)
    history: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=64))

    def crossed(
        self, reading: Reading, lines: Lines, level: float | None = None,
        rest_free: float | None = None,
    ) -> str | None:  # fmt: skip
        """Which line the reading crosses, if any, for a card that had `rest_free` free
        (default: its rest, or, while pressured, what it had when it last fired);
        `level`: the memory others hold there (default: all used)."""
        if rest_free is None:
            rest_free = self.counts_from
        free, floor = reading.free_mib, lines.acts_at(reading.total_mib, rest_free)
        if free is not None and free <= floor:
            return f"{free:,.0f} MiB free (floor {floor:,.0f})"
        # Readings far apart (a remote card's scrapes): the rise between the last ones.
        window = max(lines.window_s, 2 * (reading.fresh_s or 0.0))
        recent = [used for t, used in self.history if reading.time - t <= window]
        if not recent and self.history and reading.time - self.history[-1][0] <= lines.late_s:
            # The monitor fell behind (a busy proxy, a loaded machine): the rise since the
            # reading before is all it saw of the step, and still one.
            recent = [self.history[-1][1]]
        if recent:
            rise = (reading.used_mib if level is None else level) - min(recent)
            if rise >= lines.step_mib and (
                free is None or free <= lines.step_leaves(rise, reading.total_mib, rest_free)
            ):
                left = "" if free is None else f", {free:,.0f} MiB left"
                return f"step +{rise:,.0f} MiB{left}"
        return None

    def clear(self, reading: Reading, lines: Lines, level: float | None = None) -> bool:
        free = reading.free_mib
        room = free is None or free >= lines.clear_at(reading.total_mib, self.rest_free)
        return room and self.crossed(reading, lines, level, self.rest_free) is None

    def observe(
        self, reading: Reading, lines: Lines, own_mib: float | None = None
    ) -> Crossing | None:
        """Take a reading (with what the card's own servers hold there, where known); the
        crossing when this card must hand off now, else None."""
        self.error = None
        self._follow_own(own_mib)
        level = reading.used_mib - (self.own_mib or 0.0)
        free = reading.free_mib
        if free is not None and (self.rest_free is None or free > self.rest_free):
            self._rest(
                free, reading.time, "memory back" if self.rest_free is not None else "first read"
            )
        self.still.update(reading.time, level, lines.still_mib)
        line = self.crossed(reading, lines, level)
        self.last = reading
        if line is None:
            self.below = reading.time
        if not self.armed and self.clear(reading, lines, level):
            self.armed, self.clear_since, self.suspect = True, reading.time, None
        elif self._held_still(reading, lines) and free is not None:
            self._rest(free, reading.time, f"held still {lines.settle_s:g} s")
            self.armed, self.suspect, self.pressed_free = True, None, None
            line = None
        if line is None:
            self.suspect = None
        elif self.suspect is None:
            self.suspect = reading
            return None  # keep the baseline: the next reading confirms against it
        else:
            return self._fire(reading, line, level)
        self.history.append((reading.time, level))
        return None

    def _fire(self, reading: Reading, line: str, level: float) -> Crossing:
        crossing = Crossing(self.card, line, self.suspect.time, reading.time, self.below)
        self.suspect = None
        self.armed = False
        self.pressed_free = reading.free_mib
        self.fired += 1
        self.fired_for = line
        self.fired_at = reading.time
        self.history.clear()  # a further step counts from here
        self.history.append((reading.time, level))
        return crossing

    def _held_still(self, reading: Reading, lines: Lines) -> bool:
        """Whether what others hold has stayed put for `settle_s` at a level that is not
        the card's rest (pressured, or less free than its rest): memory that stays taken
        is the card's new rest."""
        free = reading.free_mib
        if self.still.held(reading.time) < lines.settle_s or free is None:
            return False
        return not self.armed or (
            self.rest_free is not None and free < self.rest_free - lines.still_mib
        )

    def _follow_own(self, own_mib: float | None) -> None:
        """The card's own servers took or gave back memory: its rest moves with them.
        Where that becomes known or unknown, earlier levels are not comparable."""
        before, self.own_mib = self.own_mib, own_mib
        if (before is None) != (own_mib is None):
            self.history.clear()
            self.still.restart()
            self.suspect = None
        elif before is not None and own_mib is not None and own_mib != before:
            shift = own_mib - before
            if self.rest_free is not None:
                self.rest_free -= shift
            if self.pressed_free is not None:
                self.pressed_free -= shift

    def _rest(self, free: float, at: float, how: str) -> None:
        self.rest_free, self.rest_since, self.rest_how = free, at, how

    @property
    def counts_from(self) -> float | None:
        """The free memory its lines count from now: its rest, or, while pressured, what
        it had free when it last fired."""
        return self.rest_free if self.armed else self.pressed_free

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
        self._rest(self.last.free_mib, self.last.time, "its server came up")
        self.armed, self.suspect, self.clear_since, self.pressed_free = True, None, None, None
        self.history.clear()
        self.history.append((self.last.time, self.last.used_mib - (self.own_mib or 0.0)))
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
