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
# A prompt may take this many times its expected reading before its server is left: the
# server's other answers share the card, and a measured rate moves with them.
READ_MARGIN = 4
TEMPLATE_TOKENS = 256  # a chat template's own tokens, on top of the request's


@dataclass(frozen=True)
class PaceLimits:
    first_token_s: float = 300.0  # the most from the request to the first event (prefill)
    first_token_floor_s: float = 10.0  # the least, however short the prompt
    stall_s: float = 20.0  # no bytes at all for this long, once events flow
    slow_fraction: float = 0.1  # slow: the rate over the window below this part of its own
    slow_window_s: float = 5.0

    def enabled(self) -> bool:
        return any((self.first_token_s, self.stall_s, self.slow_fraction))

    def first_token_deadline(self, request_bytes: int, read_ms: float | None) -> float:
        """How long a server may take to its first event on a request of `request_bytes`,
        where it reads a prompt token in `read_ms` (as measured; None: not known yet, and
        the ceiling applies). A token is at least a byte of text, so the request's size
        bounds its prompt's tokens from above: a long prompt is never cut for its length."""
        if not self.first_token_s or read_ms is None:
            return self.first_token_s
        expected_s = (request_bytes + TEMPLATE_TOKENS) * read_ms / 1000
        return min(self.first_token_s, max(self.first_token_floor_s, READ_MARGIN * expected_s))


def add_pace_options(loader: Any) -> None:
    loader.add_option(
        "spillover_first_token_s", int, 300,
        "The longest wait for a server's first event; 0: never leave one for its "
        "silence. Each request's own wait is its prompt's reading at the server's "
        f"measured speed, times {READ_MARGIN}, between spillover_first_token_floor_s "
        "and this; a server not yet measured gets this.",
    )  # fmt: skip
    loader.add_option(
        "spillover_first_token_floor_s", int, 10,
        "The shortest wait for a server's first event, however short the prompt.",
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
        first_token_floor_s=options.spillover_first_token_floor_s,
        stall_s=options.spillover_stall_s,
        slow_fraction=options.spillover_slow_percent / 100,
        slow_window_s=options.spillover_slow_window_s,
    )


class Pace:
    """One leg's progress: when bytes last came, and its events over time."""

    def __init__(self, started: float, limits: PaceLimits) -> None:
        self.limits = limits
        self.first_token_s = limits.first_token_s  # this leg's (see `first_token_deadline`)
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
            if self.first_token_s and quiet > self.first_token_s:
                return "stalled", f"no answer after {quiet:.1f} s (waited {self.first_token_s:g} s)"
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
