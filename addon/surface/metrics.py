"""Prometheus metrics, served at GET /spillover/metrics on the proxy port."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from addon.handoff.record import Handoff

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
RECENT = 20  # handoffs kept for the status (and the live view)


class Metrics:
    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        """`status` is the addon's status: live streams and memory cards are read from it
        at each scrape."""
        self.registry = CollectorRegistry()
        self.handoffs = Counter(
            "spillover_handoffs", "Handoffs, by what caused them.", ["kind"],
            registry=self.registry,
        )  # fmt: skip
        self.pause = Histogram(
            "spillover_handoff_pause_seconds",
            "From the handoff decision to the next server's first text at the client.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.detection = Histogram(
            "spillover_pressure_detection_seconds",
            "Pressure handoffs: from the last memory reading under every line (the memory "
            "was taken after it) to the handoff decision.",
            buckets=(0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.05, 0.1, 0.25, 0.5, 1),
            registry=self.registry,
        )
        self._status = status
        self.registry.register(self)
        # Each handoff as it is decided (one whose next leg failed included, as counted);
        # its pause fills in once the next server's first byte went out.
        self._recent: deque[tuple[float, Handoff]] = deque(maxlen=RECENT)

    def record(self, handoff: Handoff) -> None:
        """Called when a handoff is decided, and again once its pause is known."""
        if handoff.pause_ms is None:
            self.handoffs.labels(handoff.kind).inc()
            self._recent.append((round(time.time(), 3), handoff))
            if handoff.detected_within_ms is not None:
                self.detection.observe(handoff.detected_within_ms / 1000)
        else:
            self.pause.observe(handoff.pause_ms / 1000)

    def recent(self) -> list[dict[str, Any]]:
        return [{"at": at, **handoff.as_metadata()} for at, handoff in self._recent]

    def collect(self):
        status = self._status()
        live = GaugeMetricFamily("spillover_live_streams", "Answers being carried now.")
        live.add_metric([], len(status.get("live", [])))
        yield live
        cards = (status.get("memory") or {}).get("cards") or {}
        used = GaugeMetricFamily(
            "spillover_card_used_mib", "Memory used per card.", labels=["card"]
        )
        total = GaugeMetricFamily("spillover_card_total_mib", "Memory per card.", labels=["card"])
        for card, state in cards.items():
            if state.get("used_mib") is not None:
                used.add_metric([card], state["used_mib"])
            if state.get("total_mib") is not None:
                total.add_metric([card], state["total_mib"])
        yield used
        yield total
        reroutes = CounterMetricFamily(
            "spillover_reroutes",
            "New requests started away from the primary, by the primary's state.",
            labels=["state"],
        )
        routing = status.get("routing") or {}
        for state, count in (routing.get("reroutes") or {}).items():
            reroutes.add_metric([state], count)
        yield reroutes
        spent = CounterMetricFamily(
            "spillover_server_state_seconds",
            "Time each server has spent in each routing state.",
            labels=["server", "state"],
        )
        for entry in routing.get("seconds_in") or ():
            spent.add_metric([entry["server"], entry["state"]], entry["seconds"])
        yield spent

    def render(self) -> bytes:
        return generate_latest(self.registry)
