"""When a card is under pressure: the lines, and per-card state with hysteresis.

Pressure arrives as a step (another process loads and takes gigabytes at once), not as
a creep: llama-server preallocates its KV cache. So besides a used fraction and a free
floor, a rise of `step_mib` over the last `window_s` that leaves less than `step_free_mib`
free is a line too. Every line must hold on two samples in a row, so one noisy sample
never fires; a card that fired stays quiet until it is clearly below the lines again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from watchers.reading import Reading


@dataclass(frozen=True)
class Lines:
    used_fraction: float = 0.95
    free_floor_mib: float = 512
    step_mib: float = 1024
    step_free_mib: float = 4096
    window_s: float = 0.25
    rearm_margin: float = 0.05  # below used_fraction by this much, and free above twice the floor


@dataclass
class CardState:
    card: str
    last: Reading | None = None
    error: str | None = None
    armed: bool = True
    fired: int = 0
    fired_for: str | None = None  # the line it last fired on
    clear_since: float | None = None  # when it was last re-armed (reading time)
    suspect: str | None = None  # a line crossed on the previous sample, awaiting confirmation
    history: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=64))

    def crossed(self, reading: Reading, lines: Lines) -> str | None:
        """Which line the reading crosses, if any."""
        if reading.fraction is not None and reading.fraction >= lines.used_fraction:
            return f"{reading.fraction:.1%} used (line {lines.used_fraction:.0%})"
        free = reading.free_mib
        if free is not None and free <= lines.free_floor_mib:
            return f"{free:,.0f} MiB free (floor {lines.free_floor_mib:,.0f})"
        recent = [used for t, used in self.history if reading.time - t <= lines.window_s]
        if recent:
            rise = reading.used_mib - min(recent)
            if rise >= lines.step_mib and (free is None or free <= lines.step_free_mib):
                left = "" if free is None else f", {free:,.0f} MiB left"
                return f"step +{rise:,.0f} MiB{left}"
        return None

    def clear(self, reading: Reading, lines: Lines) -> bool:
        fraction_ok = reading.fraction is None or (
            reading.fraction < lines.used_fraction - lines.rearm_margin
        )
        free_ok = reading.free_mib is None or reading.free_mib > 2 * lines.free_floor_mib
        return fraction_ok and free_ok and self.crossed(reading, lines) is None

    def observe(self, reading: Reading, lines: Lines) -> str | None:
        """Take a reading; the reason when this card must hand off now, else None."""
        self.error = None
        line = self.crossed(reading, lines)
        self.last = reading
        if not self.armed:
            if self.clear(reading, lines):
                self.armed = True
                self.clear_since = reading.time
            self.suspect = None
        elif line is None:
            self.suspect = None
        elif self.suspect is None:
            self.suspect = line
            return None  # keep the baseline: the next sample confirms against it
        else:
            self.suspect = None
            self.armed = False
            self.fired += 1
            self.fired_for = line
            self.history.append((reading.time, reading.used_mib))
            return line
        self.history.append((reading.time, reading.used_mib))
        return None

    def pressed(self, now: float, dwell_s: float) -> str | None:
        """Why the card is not yet fit for new work: over a line (fired, not re-armed),
        or re-armed less than `dwell_s` ago. None when it is clear."""
        if not self.armed:
            return f"{self.card}: {self.fired_for or 'over a line'}"
        if self.clear_since is not None and now - self.clear_since < dwell_s:
            return f"{self.card}: clear for {now - self.clear_since:.1f} s of {dwell_s:g}"
        return None

    def fail(self, error: str) -> None:
        """A failed or stale reading: reported, and never part of a decision."""
        self.error = error
        self.suspect = None
