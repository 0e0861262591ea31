"""A handoff's record: why an answer moved, from where to where, how it was replayed, and
what its KV migration did."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sensed:
    """When the memory watcher saw the pressure behind a handoff (time.monotonic()): the
    reading that first crossed a line, and the last reading under every line before it
    (the memory was taken between the two)."""

    crossed: float
    last_below: float | None


# A restore that saved less than this share of the tokens it holds was read again.
REUSED_AT_LEAST = 0.5


@dataclass
class Moved:
    """A migration's outcome, for the handoff's record."""

    slot: int | None = None  # the target's slot holding the answer; None: it replays
    why: str = ""
    tokens: int = 0
    size: int = 0  # bytes of the saved state
    find_ms: float | None = None  # until the cut source's slot was idle and found
    save_ms: float | None = None
    restore_ms: float | None = None
    took_ms: float | None = None  # every step, as the answer waited
    # What the continuation then really did, as its server timed its first token: the
    # tokens it took from the restored cache, and those it read itself.
    reused: int | None = None
    read: int | None = None

    @property
    def outcome(self) -> str:
        """ "reused", "read again" (restored, and the server read it all the same),
        "restored" (not known which), "failed" or "not moved"."""
        if self.slot is None:
            return "failed" if self.why.startswith("migration failed") else "not moved"
        if self.reused is None:
            return "restored"
        return "read again" if self.read_again else "reused"

    @property
    def read_again(self) -> bool:
        return self.reused is not None and self.reused < self.tokens * REUSED_AT_LEAST

    def as_metadata(self) -> dict[str, Any]:
        meta = {k: v for k, v in self.__dict__.items() if v is not None}
        return meta | {"outcome": self.outcome}


@dataclass
class Handoff:
    reason: str
    source: str
    target: str
    at_token: int
    at_char: int
    decided: float
    # "pressure" (the watcher), "requested" (a person, a drain), "failure", "stalled",
    # "slow", "handback" (back to the primary once it is clear)
    kind: str
    pause_ms: float | None = None
    replay: str | None = None  # "token ids" or "text"; None while nothing was delivered
    # How the target is known to continue, where its engine cannot say what it reads:
    # "behaviour" or "declared" (ServerInfo.proof); None: its engine's own routes.
    proof: str | None = None
    caveat: str | None = None  # a promise of the request this handoff cannot keep
    # Pressure handoffs: how long before the decision the reading that crossed the line
    # was taken, and the last reading under it (the memory was taken within that time).
    crossed_ms: float | None = None
    detected_within_ms: float | None = None
    migration: Moved | None = None  # with spillover_slot_dir: moved, or why not
    passed_by: str | None = None  # why servers before the target may not continue it

    def sensed(self, sensed: Sensed) -> None:
        self.crossed_ms = round((self.decided - sensed.crossed) * 1000, 2)
        if sensed.last_below is not None:
            self.detected_within_ms = round((self.decided - sensed.last_below) * 1000, 2)

    def as_metadata(self) -> dict[str, Any]:
        meta = {k: v for k, v in vars(self).items() if k != "decided"}
        if self.migration is not None:
            meta["migration"] = self.migration.as_metadata()
        return meta

    def describe(self) -> str:
        pause = f", first byte after {self.pause_ms:.1f} ms" if self.pause_ms is not None else ""
        replay = f", replayed as {self.replay}" if self.replay else ""
        if (moved := self.migration) is not None:
            replay += f", {moved.why}" + (
                f" in {moved.took_ms:.0f} ms" if moved.slot is not None else ""
            )
            if moved.reused is not None:
                replay += f" (the continuation reused {moved.reused} tokens, read {moved.read})"
        caveat = f"; {self.caveat}" if self.caveat else ""
        caveat += f"; passed by: {self.passed_by}" if self.passed_by else ""
        if self.detected_within_ms is not None:
            reason = f"{self.reason}, seen within {self.detected_within_ms:.0f} ms"
        else:
            reason = self.reason
        return (
            f"handoff {self.source} -> {self.target} after {self.at_token} tokens "
            f"({reason}){replay}{pause}{caveat}"
        )


def seeded_sampling(body: dict[str, Any]) -> bool:
    """A seed promises a reproducible answer; the random state cannot move with it.
    (llama-server samples at temperature 0.8 unless told otherwise.)"""
    return body.get("seed") is not None and body.get("temperature", 0.8) != 0
