"""The monitor thread: samples every source at a short interval and reports pressure.

A sample of the sysfs and meminfo sources reads two or three small files (tens of
microseconds); NVML's memory query is a driver call of similar cost. `wake()` samples at
once (udev change events call it). Failing or stale readings are reported in `status()`
and never trigger anything; an exception in a source is logged and the thread goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from watchers.pressure import CardState, Lines
from watchers.reading import CardFailure, Source

log = logging.getLogger(__name__)
OnPressure = Callable[[str, str], None]  # (card, reason)


class MemoryMonitor:
    def __init__(
        self,
        sources: Sequence[Source],
        on_pressure: OnPressure,
        lines: Lines | None = None,
        interval: float = 0.02,
        stale_after: float = 1.0,
    ) -> None:
        self.sources = list(sources)
        self.on_pressure = on_pressure
        self.lines = lines or Lines()
        self.interval = interval
        self.stale_after = stale_after
        self.cards: dict[str, CardState] = {}
        self.source_errors: dict[str, str] = {}
        self.samples = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="spillover-memory", daemon=True)

    def start(self) -> MemoryMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

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
            self._wake.wait(self.interval)
            self._wake.clear()

    def sample(self) -> None:
        fired: list[tuple[str, str]] = []
        with self._lock:
            self.samples += 1
            for source in self.sources:
                try:
                    results = source.read()
                except Exception as exc:
                    if self.source_errors.get(source.name) != repr(exc):
                        log.warning("memory source %s failed: %r", source.name, exc)
                    self.source_errors[source.name] = repr(exc)
                    continue
                self.source_errors.pop(source.name, None)
                for result in results:
                    state = self.cards.setdefault(result.card, CardState(result.card))
                    if isinstance(result, CardFailure):
                        state.fail(result.error)
                    elif (reason := state.observe(result, self.lines)) is not None:
                        fired.append((result.card, reason))
            now = time.monotonic()
            for state in self.cards.values():
                if state.last is not None and now - state.last.time > self.stale_after:
                    state.fail(f"stale: no reading for {now - state.last.time:.1f}s")
        for card, reason in fired:
            log.warning("memory pressure on %s: %s", card, reason)
            self.on_pressure(card, reason)

    def pressed(self, cards: set[str], now: float, dwell_s: float) -> str | None:
        """Why any of these cards is not yet fit for new work, or None."""
        with self._lock:
            for card in sorted(cards):
                state = self.cards.get(card)
                if state is not None and (why := state.pressed(now, dwell_s)) is not None:
                    return why
        return None

    def forget(self, card: str) -> None:
        """A card went away (hotplug): drop its state."""
        with self._lock:
            self.cards.pop(card, None)

    def status(self) -> dict:
        with self._lock:
            return {
                "alive": self.alive,
                "samples": self.samples,
                "interval_ms": self.interval * 1000,
                "source_errors": dict(self.source_errors),
                "cards": {
                    card: {
                        "used_mib": None if s.last is None else round(s.last.used_mib, 1),
                        "total_mib": None if s.last is None else s.last.total_mib,
                        "armed": s.armed,
                        "fired": s.fired,
                        "error": s.error,
                    }
                    for card, s in self.cards.items()
                },
            }
