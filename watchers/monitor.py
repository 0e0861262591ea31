"""The monitor thread: samples every source and reports pressure.

A sample of the sysfs and meminfo sources reads two or three small files (tens of
microseconds); NVML's memory query is a driver call of similar cost, so what an idle
monitor costs is mostly its wake-ups. It samples every `interval` while any card is near
its lines (a sudden allocation of at most NEAR_MIB would fire), every SLOW_FACTOR
intervals while all are far, and a reading over a line is confirmed CONFIRM_S later
rather than a whole interval. `wake()` samples at once (udev change events call it).
Failing or stale readings are reported in `status()` and never trigger anything; an
exception in a source is logged and the thread goes on.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from watchers.pressure import CardState, Crossing, Lines
from watchers.reading import CardFailure, Reading, Source

log = logging.getLogger(__name__)
OnPressure = Callable[[Crossing], None]
Results = list[Reading | CardFailure] | Exception  # a source's readings, or why it failed
OwnPids = Callable[[], set[int]]
NEAR_MIB = 8192.0
SLOW_FACTOR = 10
CONFIRM_S = 0.003


class MemoryMonitor:
    def __init__(
        self,
        sources: Sequence[Source],
        on_pressure: OnPressure,
        lines: Lines | None = None,
        interval: float = 0.02,
        stale_after: float = 1.0,
        own_pids: OwnPids = set,
    ) -> None:
        """`own_pids()`: the processes of the servers this proxy fronts (what they hold
        on a card, where its source tells, is theirs: never pressure)."""
        self.sources = list(sources)
        self.own_pids = own_pids
        self.on_pressure = on_pressure
        # Two readings at its slowest pace, or late, still measure a step between them
        # (a longer spillover_interval_ms would otherwise sample past the step window).
        lines = lines or Lines()
        self.lines = replace(lines, late_s=max(lines.late_s, 2 * interval * SLOW_FACTOR))
        self.interval = interval
        self.stale_after = stale_after
        self.cards: dict[str, CardState] = {}
        self.source_errors: dict[str, str] = {}
        self.samples = 0
        self.next_wait = interval
        self.reported: set[str] = set()  # cards read in the last sample
        self._wake = _Wakeup()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the card states, as the event loop reads them
        self._sampling = threading.Lock()  # one sample (or rescan) at a time
        self._thread = threading.Thread(target=self._run, name="spillover-memory", daemon=True)

    def start(self) -> MemoryMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        if not self._thread.is_alive():
            self._wake.close()

    def wake(self) -> None:
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception:  # a bug in one sample must not end the watching
                log.exception("memory sample failed")
            self._wake.wait(self.next_wait)

    def sample(self) -> None:
        fired: list[Crossing] = []
        # The sources are read, and the servers' processes looked up, outside the lock the
        # event loop takes (judge, near, status): a driver call or a /proc walk that takes
        # long must never hold up routing or every live answer's pace check.
        with self._sampling:
            read: list[tuple[Source, Results]] = [(s, _read(s)) for s in self.sources]
            own = self._own_pids() if self._owners_moved(read) else None
            with self._lock:
                self.samples += 1
                self.reported = set()
                for source, results in read:
                    if isinstance(results, Exception):
                        if self.source_errors.get(source.name) != repr(results):
                            log.warning("memory source %s failed: %r", source.name, results)
                        self.source_errors[source.name] = repr(results)
                        continue
                    self.source_errors.pop(source.name, None)
                    for result in results:
                        if (crossing := self._take(result, own)) is not None:
                            fired.append(crossing)
                now = time.monotonic()
                for state in self.cards.values():
                    if state.last is None:
                        continue
                    bound = state.last.fresh_for(self.stale_after)
                    if now - state.last.time > bound:
                        age = now - state.last.time
                        state.fail(f"stale: no reading for {age:.1f} s (fresh for {bound:g} s)")
                self.next_wait = self._pace()
        for crossing in fired:
            log.warning("memory pressure on %s: %s", crossing.card, crossing.line)
            self.on_pressure(crossing)

    def _owners_moved(self, read: list[tuple[Source, Results]]) -> bool:
        """Whether a reading says who holds memory, and who holds what has moved since its
        card's last reading: the servers' processes are then looked up (once a sample).
        (The card states are the sampling thread's to change: read here without the lock.)"""
        cards = self.cards
        return any(
            not isinstance(result, CardFailure) and _holders_moved(cards.get(result.card), result)
            for _, results in read
            for result in (() if isinstance(results, Exception) else results)
        )

    def _take(self, result: Reading | CardFailure, own: set[int] | None) -> Crossing | None:
        """One card's reading, into its state (under the lock); the crossing it confirms."""
        self.reported.add(result.card)
        state = self.cards.setdefault(result.card, CardState(result.card))
        first = state.last is None
        crossing = None
        if isinstance(result, CardFailure):
            state.fail(result.error)
        elif state.last is not None and result.time == state.last.time:
            # A source that reads at its own pace: nothing new. After a failed read, what
            # it still has counts again while it is fresh.
            fresh = time.monotonic() - result.time <= result.fresh_for(self.stale_after)
            if state.error is not None and fresh:
                state.error = None
        else:
            if _holders_moved(state, result):
                mine = None if own is None else result.held_by(own)
            else:  # neither has the servers' share (looked up only where it may have)
                mine = None if result.held is None else state.own_mib
            crossing = state.observe(result, self.lines, mine)
            held_still = state.rest_since == result.time and state.rest_how.startswith("held")
            if crossing is None and held_still:
                log.info("%s", self.at_rest(state))
        if first and state.last is not None:
            log.info("%s", self.at_rest(state))
        return crossing

    def _own_pids(self) -> set[int]:
        try:
            return set(self.own_pids())
        except Exception:  # not knowing whose memory it is is no reason to stop watching
            log.exception("finding the servers' processes failed")
            return set()

    def _pace(self) -> float:
        states = self.cards.values()
        if any(s.suspect is not None and s.suspect.fresh_s is None for s in states):
            return CONFIRM_S  # (a remote card's confirmation comes with its next scrape)
        if any(s.last is None or s.within(self.lines, NEAR_MIB) for s in states):
            return self.interval
        return self.interval * SLOW_FACTOR

    def rescan(self) -> None:
        """Cards appeared, went or changed (hotplug): sources look again, and the state
        of every card that went, or whose name now means another card, is dropped."""
        with self._sampling:  # never while the monitor thread reads the same source
            gone: set[str] = set()
            for source in self.sources:
                if (rescan := getattr(source, "rescan", None)) is not None:
                    gone |= rescan() or set()
            with self._lock:
                for card in gone:
                    self.cards.pop(card, None)
        self.sample()
        with self._lock:
            if not self.source_errors:
                for card in set(self.cards) - self.reported:
                    del self.cards[card]

    def settle(self, cards: set[str], since: float) -> None:
        """A server on these cards came up after being down from `since`: what they hold
        now is their rest (its model filling a card is not pressure), and any that fired
        while it was down (loading) is clear."""
        with self._lock:
            for card in sorted(cards):
                if (state := self.cards.get(card)) is not None and state.settle(since):
                    log.info("%s", self.at_rest(state))

    def at_rest(self, state: CardState) -> str:
        """What a card has at rest and what it will act on, in words."""
        last = state.last
        assert last is not None
        if last.free_mib is None:
            use = f"{last.used_mib:,.0f} MiB used"
        else:
            use = f"{state.rest_free:,.0f} MiB free of {last.total_mib:,.0f} at rest"
            if state.rest_how.startswith("held"):
                use += f" (its memory {state.rest_how})"
        acts_on = self.lines.acts_on(last.total_mib, state.rest_free)
        return f"{state.card}: {use}; hands off on {acts_on}"

    def seen(self) -> set[str]:
        """Every card some source has reported."""
        with self._lock:
            return set(self.cards)

    def judge(self, cards: set[str], now: float, dwell_s: float) -> tuple[str, str] | None:
        """("pressured", why) when any of these cards is not yet fit for new work (over a
        line, or clear for less than `dwell_s`); else ("unknown", why) when any cannot be
        judged now (its reading failed or is stale); None when all are clear. A card no
        source reads is not watched, so neither: its memory is not this proxy's to judge."""
        unknown = None
        with self._lock:
            for card in sorted(cards):
                if (state := self.cards.get(card)) is None:
                    continue
                if (why := state.pressed(now, dwell_s)) is not None:
                    return "pressured", why
                unknown = unknown or state.unknown()
        return None if unknown is None else ("unknown", unknown)

    def near(self, cards: set[str], margin_mib: float) -> bool:
        """Whether any of these cards is over a line, or a sudden allocation of at most
        `margin_mib` would cross one."""
        with self._lock:
            for card in cards:
                state = self.cards.get(card)
                if state is None or state.last is None:
                    continue
                if not state.armed or state.within(self.lines, margin_mib):
                    return True
        return False

    def status(self) -> dict:
        now = time.monotonic()
        with self._lock:
            return {
                "alive": self.alive,
                "samples": self.samples,
                "interval_ms": self.interval * 1000,
                "sampling_every_ms": round(self.next_wait * 1000, 1),
                "source_errors": dict(self.source_errors),
                "cards": {
                    card: {
                        "used_mib": None if s.last is None else round(s.last.used_mib, 1),
                        "total_mib": None if s.last is None else s.last.total_mib,
                        "floor_mib": None
                        if s.last is None
                        else round(self.lines.acts_at(s.last.total_mib, s.counts_from), 1),
                        "rest_free_mib": None if s.rest_free is None else round(s.rest_free, 1),
                        "acts_on": None
                        if s.last is None
                        else self.lines.acts_on(s.last.total_mib, s.counts_from),
                        "armed": s.armed,
                        "fired": s.fired,
                        "error": s.error,
                        **self._since(s, now),
                    }
                    for card, s in self.cards.items()
                },
            }

    def _since(self, state: CardState, now: float) -> dict:
        """What the card acts on now and since when (seconds ago), and who holds its
        memory where the source says (pid: MiB, and whether it is a server's own)."""
        last = state.last
        if last is None:
            return {}
        if state.armed:
            since, why = state.rest_since, f"at rest since: {state.rest_how}"
            if state.clear_since is not None and now - state.clear_since < 3600:
                since, why = state.clear_since, "re-armed: memory came back"
        else:
            since, why = state.fired_at, f"pressured: {state.fired_for}"
        settling = None
        if last.free_mib is not None and not state.armed:
            settling = round(max(self.lines.settle_s - state.still.held(now), 0.0), 1)
        return {
            "state": why,
            "since_s": None if since is None else round(now - since, 1),
            "rearms_if_still_for_s": settling,
            "own_mib": None if state.own_mib is None else round(state.own_mib, 1),
            "holders": None
            if last.held is None
            else [{"pid": pid, "mib": round(mib, 1)} for pid, mib in last.held],
        }


def _holders_moved(state: CardState | None, result: Reading) -> bool:
    """Whether the reading says who holds the card's memory, and that has moved since
    the card's last reading (or there is none)."""
    if result.held is None:
        return False
    return state is None or state.last is None or result.held != state.last.held


def _read(source: Source) -> Results:
    try:
        return source.read()
    except Exception as exc:  # reported in status; the other sources go on
        return exc


class _Wakeup:
    """A timed wait that another thread can cut short: one poll(2) on an eventfd. Most
    of an idle monitor's cost is its wake-ups; this one costs half of Event.wait's."""

    def __init__(self) -> None:
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN)

    def set(self) -> None:
        if self._fd >= 0:
            os.eventfd_write(self._fd, 1)

    def wait(self, seconds: float) -> None:
        if self._poll.poll(seconds * 1000):
            os.eventfd_read(self._fd)  # woken: reset

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
