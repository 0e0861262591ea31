"""How fast a leg is going: a stalled or badly slowed server is left like a failed one.

A server that hangs (a wedged driver) sends nothing more; one whose memory spilled into
system RAM goes on 10-50x slower. Neither closes the connection, so without a watch the
client waits until mitmproxy's own timeout cuts it off. Each leg keeps a `Pace`, and the
addon looks at every live leg a few times a second.

The wait for a leg's first event is learnt per server: from llama-server's own timing of
its prompt readings where it gives them, else from how long each answer that passed took
to its first event (`FirstEvents`, any engine). A server never measured gets
`first_token_unmeasured_s`; a server past its wait that is still at work (its slots, or
its token counts: `answer.stillreading`) gets as long again, up to `first_token_s` in all.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

BASELINE_TOKENS = 32  # a leg's own rate means something once it has sent this many
# A prompt may take this many times its expected reading before its server is left: the
# server's other answers share the card, and a measured rate moves with them.
READ_MARGIN = 4
TEMPLATE_TOKENS = 256  # a chat template's own tokens, on top of the request's
FIRST_EVENTS_KEPT = 32  # the answers a server's wait is learnt from (the slowest counts)


@dataclass(frozen=True)
class PaceLimits:
    first_token_s: float = 300.0  # the most from the request to the first event (prefill)
    first_token_floor_s: float = 10.0  # the least, however short the prompt
    first_token_unmeasured_s: float = 60.0  # the wait on a server never measured
    stall_s: float = 20.0  # no bytes at all for this long, once events flow
    slow_fraction: float = 0.1  # slow: the rate over the window below this part of its own
    slow_window_s: float = 5.0

    def enabled(self) -> bool:
        return any((self.first_token_s, self.stall_s, self.slow_fraction))

    def first_token_deadline(
        self, request_bytes: int, read_ms: float | None, first_ms: float | None = None
    ) -> float:
        """How long a server may take to its first event on a request of `request_bytes`,
        where it reads a prompt token in `read_ms` (llama-server's own timing) or has
        taken `first_ms` per request byte to its first event (any engine); None: not
        measured yet, and `first_token_unmeasured_s` applies. A token is at least a byte
        of text, so the request's size bounds its prompt's tokens from above: a long
        prompt is never cut for its length."""
        per_token = read_ms if read_ms is not None else first_ms
        if not self.first_token_s:
            return 0.0
        if per_token is None:
            return min(self.first_token_s, self.first_token_unmeasured_s or self.first_token_s)
        expected_s = (request_bytes + TEMPLATE_TOKENS) * per_token / 1000
        return min(self.first_token_s, max(self.first_token_floor_s, READ_MARGIN * expected_s))


@dataclass
class FirstEvents:
    """How long each server took to its first event, per request byte, over the last
    answers that got one: the slowest counts (a prompt the server had cached reads fast,
    and must not shorten the wait for one it has not)."""

    ms_per_byte: dict[str, deque[float]] = field(default_factory=dict)

    def saw(self, server: str, request_bytes: int, seconds: float) -> None:
        kept = self.ms_per_byte.setdefault(server, deque(maxlen=FIRST_EVENTS_KEPT))
        kept.append(seconds * 1000 / (request_bytes + TEMPLATE_TOKENS))

    def of(self, server: str) -> float | None:
        kept = self.ms_per_byte.get(server)
        return max(kept) if kept else None

    def status(self) -> dict[str, float]:
        return {server: round(max(kept), 4) for server, kept in self.ms_per_byte.items() if kept}


def add_pace_options(loader: Any) -> None:
    loader.add_option(
        "spillover_first_token_s", int, 300,
        "The longest wait for a server's first event; 0: never leave one for its "
        "silence. Each request's own wait is its prompt's reading at the server's "
        f"measured speed, times {READ_MARGIN}, between spillover_first_token_floor_s "
        "and this; a server not yet measured gets this.",
    )  # fmt: skip
    loader.add_option(
        "spillover_first_token_unmeasured_s", int, 60,
        "The wait for the first event of a server whose speed was never measured (no "
        "answer through the proxy yet); a server still at work (llama-server's /slots, "
        "or token counts in /metrics that move: vLLM's) then gets as long again, up to "
        "spillover_first_token_s.",
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
        first_token_unmeasured_s=options.spillover_first_token_unmeasured_s,
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
        self.heard = 0.0  # the same, 0.0 until the first bytes came
        self.events = 0
        self.asking: asyncio.Future[None] | None = None  # is it still reading? (being asked)
        # Told the first event came, this long after the leg started.
        self.on_first: Callable[[float], None] = lambda _: None
        self._samples: deque[tuple[float, int]] = deque()

    def saw(self, now: float, events: int = 0) -> None:
        self.last = self.heard = now
        if events:
            if self.first is None:
                self.first = now
                self.on_first(now - self.started)
            self.events += events

    def stretch(self, now: float) -> None:
        """The server says it is still reading the prompt: as long again from now."""
        self.last = now

    def verdict(self, now: float) -> tuple[str, str] | None:
        """("silent", "stalled" or "slow", why) when the leg should be left (silent: no
        first event in its time); None while it is fine."""
        limits = self.limits
        quiet = now - self.last
        if self.first is None:
            if limits.first_token_s and now - self.started > limits.first_token_s:
                waited = now - self.started
                return "stalled", f"no answer after {waited:.1f} s (the most any server gets)"
            if self.first_token_s and quiet > self.first_token_s:
                return "silent", f"no answer after {quiet:.1f} s (waited {self.first_token_s:g} s)"
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
