"""How fast a leg is going: a stalled or badly slowed server is left like a failed one.

A server that hangs (a wedged driver) sends nothing more; one whose memory spilled into
system RAM goes on 10-50x slower. Neither closes the connection, so without a watch the
client waits until mitmproxy's own timeout cuts it off. Each leg keeps a `Pace`, and the
addon looks at every live leg a few times a second.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

BASELINE_TOKENS = 32  # a leg's own rate means something once it has sent this many


@dataclass(frozen=True)
class PaceLimits:
    first_token_s: float = 300.0  # from the request to the first event (the prompt's prefill)
    stall_s: float = 20.0  # no bytes at all for this long, once events flow
    slow_fraction: float = 0.1  # slow: the rate over the window below this part of its own
    slow_window_s: float = 5.0

    def enabled(self) -> bool:
        return any((self.first_token_s, self.stall_s, self.slow_fraction))


def add_pace_options(loader: Any) -> None:
    loader.add_option(
        "spillover_first_token_s", int, 300,
        "Leave a server that has sent no answer this long after the request "
        "(its prompt's prefill included); 0: never.",
    )  # fmt: skip
    loader.add_option(
        "spillover_stall_s", int, 20,
        "Leave a server that sends nothing for this long mid-answer; 0: never.",
    )  # fmt: skip
    loader.add_option(
        "spillover_slow_percent", int, 10,
        "Leave a server whose answer slows below this percentage of its own earlier "
        "rate for spillover_slow_window_s; 0: never.",
    )  # fmt: skip
    loader.add_option(
        "spillover_slow_window_s", int, 5, "How long a slowdown must last (seconds).",
    )  # fmt: skip


def limits_from(options: Any) -> PaceLimits:
    return PaceLimits(
        first_token_s=options.spillover_first_token_s,
        stall_s=options.spillover_stall_s,
        slow_fraction=options.spillover_slow_percent / 100,
        slow_window_s=options.spillover_slow_window_s,
    )


class Pace:
    """One leg's progress: when bytes last came, and its events over time."""

    def __init__(self, started: float, limits: PaceLimits) -> None:
        self.limits = limits
        self.started = started
        self.first: float | None = None  # when the first event came
        self.last = started  # when the last bytes came
        self.events = 0
        self._samples: deque[tuple[float, int]] = deque()

    def saw(self, now: float, events: int = 0) -> None:
        self.last = now
        if events:
            if self.first is None:
                self.first = now
            self.events += events

    def verdict(self, now: float) -> tuple[str, str] | None:
        """("stalled" or "slow", why) when the leg should be left; None while it is fine."""
        limits = self.limits
        quiet = now - self.last
        if self.first is None:
            if limits.first_token_s and quiet > limits.first_token_s:
                return "stalled", f"no answer after {quiet:.1f} s"
            return None
        if limits.stall_s and quiet > limits.stall_s:
            return "stalled", f"nothing for {quiet:.1f} s after {self.events} events"
        if not limits.slow_fraction:
            return None
        samples = self._samples
        samples.append((now, self.events))
        window = limits.slow_window_s
        while len(samples) > 1 and samples[1][0] <= now - window:
            samples.popleft()
        since, before = samples[0]
        if now - since < window or before < BASELINE_TOKENS or since <= self.first:
            return None
        usual = before / (since - self.first)
        recent = (self.events - before) / (now - since)
        if recent < limits.slow_fraction * usual:
            return "slow", f"{recent:.1f} events/s over {window:g} s, down from {usual:.1f}"
        return None
