"""What every memory source reports: one reading per card."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

MIB = 1024 * 1024


@dataclass(frozen=True)
class Reading:
    card: str  # e.g. "nvml:0", "drm:card1", "ram"
    used_mib: float
    total_mib: float | None  # None where the source cannot know (DRM fdinfo alone)
    time: float  # time.monotonic() when read (for a remote card: when it was measured)
    # How long it stays fresh, for a source whose readings arrive at their own pace (a
    # remote card, scraped every few seconds); None: the monitor's bound for local cards.
    fresh_s: float | None = None
    # Who holds its memory, where the source tells (NVML's process list, DRM fdinfo):
    # (pid, MiB) pairs; None where it cannot.
    held: tuple[tuple[int, float], ...] | None = None

    def fresh_for(self, default_s: float) -> float:
        """How long after `time` it counts: its own bound, else `default_s`."""
        return self.fresh_s or default_s

    def held_by(self, pids: set[int]) -> float | None:
        """What these processes hold on the card, where the source tells."""
        if self.held is None:
            return None
        return sum(mib for pid, mib in self.held if pid in pids)

    @property
    def free_mib(self) -> float | None:
        return None if self.total_mib is None else self.total_mib - self.used_mib

    @property
    def fraction(self) -> float | None:
        return None if not self.total_mib else self.used_mib / self.total_mib


@dataclass(frozen=True)
class CardFailure:
    """A card that could not be read this time (file gone, garbage in it, driver error)."""

    card: str
    error: str


class NotApplicable(Exception):
    """The source does not apply on this machine; the message says why and how to fix it."""


class Source(Protocol):
    name: str

    def read(self) -> list[Reading | CardFailure]:
        """Current readings; raises OSError when the whole source fails."""
        ...
