"""Prometheus metrics, served at GET /spillover/metrics on the proxy port."""

from __future__ import annotations

import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from addon.handoff.record import Handoff
from watchers.exporters import REMOTE_PREFIX

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
RECENT = 20  # handoffs kept for the status (and the live view)
HOST = socket.gethostname()


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
        self.migrations = Counter(
            "spillover_migrations",
            "KV migrations tried at handoffs, by what the continuation then did: reused "
            "(it read little again), read again (its server re-read the restored state), "
            "restored (not known), failed, not moved.",
            ["outcome"],
            registry=self.registry,
        )
        self.continuations = Counter(
            "spillover_continuations",
            "Continuations that reached the client, by how their server is known to "
            "continue: engine (its own routes), behaviour (a probe through its chat route), "
            "declared (its operator's word, not proven).",
            ["proof"],
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
            if handoff.replay is not None:
                self.continuations.labels(handoff.proof or "engine").inc()
            if handoff.migration is not None:
                self.migrations.labels(handoff.migration.outcome).inc()

    def recent(self) -> list[dict[str, Any]]:
        return [{"at": at, **handoff.as_metadata()} for at, handoff in self._recent]

    def collect(self):
        status = self._status()
        live = GaugeMetricFamily("spillover_live_streams", "Answers being carried now.")
        live.add_metric([], len(status.get("live", [])))
        yield live
        yield from self._cards(status)
        reroutes = CounterMetricFamily(
            "spillover_reroutes",
            "New requests started away from the primary, by the primary's state.",
            labels=["state"],
        )
        routing = status.get("routing") or {}
        for state, count in (routing.get("reroutes") or {}).items():
            reroutes.add_metric([state], count)
        yield reroutes
        refusals = CounterMetricFamily(
            "spillover_refusals",
            "Requests a server refused before their first byte that went elsewhere or were "
            "retried, by kind (busy, out_of_context, retried).",
            labels=["kind"],
        )
        for kind, count in (routing.get("refusals") or {}).items():
            refusals.add_metric([kind], count)
        yield refusals
        declined = CounterMetricFamily(
            "spillover_handoffs_declined",
            "Handoffs not made because no server could go on with the answer, by kind.",
            labels=["kind"],
        )
        for kind, count in ((status.get("declined_handoffs") or {}).get("counts") or {}).items():
            declined.add_metric([kind], count)
        yield declined
        spent = CounterMetricFamily(
            "spillover_server_state_seconds",
            "Time each server has spent in each routing state.",
            labels=["server", "state"],
        )
        for entry in routing.get("seconds_in") or ():
            spent.add_metric([entry["server"], entry["state"]], entry["seconds"])
        yield spent
        now = GaugeMetricFamily(
            "spillover_server_state",
            "1 for each server's routing state now (ok, unknown, pressured, busy, down, draining).",
            labels=["server", "state"],
        )
        slow = GaugeMetricFamily(
            "spillover_server_health_slow",
            "1 for a server whose /health times out while it is loaded (it stays up), with "
            "what shows the load: 'while it streams' or 'while its processes work'.",
            labels=["server", "why"],
        )
        for server, state in (routing.get("states") or {}).items():
            now.add_metric([server, state["state"]], 1)
            if (health := state.get("health")) is not None:
                slow.add_metric([server, health.removeprefix("slow ")], 1)
        yield now
        yield slow

    def _cards(self, status: dict[str, Any]):
        """This machine's cards, with the host they are on, so that another proxy reading
        them through Prometheus can tell whose they are (remote cards are not passed on)."""
        cards = (status.get("memory") or {}).get("cards") or {}
        labels = ["host", "card"]
        used = GaugeMetricFamily("spillover_card_used_mib", "Memory used per card.", labels=labels)
        total = GaugeMetricFamily("spillover_card_total_mib", "Memory per card.", labels=labels)
        free = GaugeMetricFamily("spillover_card_free_mib", "Memory free per card.", labels=labels)
        for card, state in cards.items():
            if card.startswith(REMOTE_PREFIX) or state.get("used_mib") is None:
                continue
            used.add_metric([HOST, card], state["used_mib"])
            if state.get("total_mib") is not None:
                total.add_metric([HOST, card], state["total_mib"])
                free.add_metric([HOST, card], state["total_mib"] - state["used_mib"])
        yield from (used, total, free)

    def render(self) -> bytes:
        return generate_latest(self.registry)
