"""The MemoryWatch addon: runs the memory monitor and turns pressure into handoffs.

Only streams whose current server uses the card under pressure are handed off
(`watchers.gates`). If the monitor cannot start or dies, traffic flows as before.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from mitmproxy import ctx, exceptions

from addon.handoff.record import Sensed
from addon.servers import keyed
from addon.servers.credentials import read_secret
from addon.servers.urlchecks import option_mistakes
from addon.surface.mistakes import refuse_at_start
from addon.surface.proxy import SERVER_OPTIONS, Spillover
from watchers.cardids import unknown_cards
from watchers.gates import PROMETHEUS, CardMap, Mapping
from watchers.hotplug import HotplugEvents, UdevObserver
from watchers.monitor import MemoryMonitor
from watchers.pressure import Crossing, Lines
from watchers.prometheus import Matcher, PrometheusSource
from watchers.reading import NotApplicable, Source
from watchers.sources import ALL, card_map, open_sources

log = logging.getLogger(__name__)
WATCH_OPTIONS = {
    "spillover_watch", "spillover_sources", "spillover_sysfs_root", "spillover_proc_root",
    "spillover_interval_ms", "spillover_free_floor_mib", "spillover_step_mib",
    "spillover_rearm_mib", "spillover_settle_s", "spillover_cards", "spillover_prometheus",
    "spillover_prometheus_token", "spillover_prometheus_interval_ms", "spillover_remote_cards",
}  # fmt: skip


class MemoryWatch:
    def __init__(self, spillover: Spillover) -> None:
        self.spillover = spillover
        self.monitor: MemoryMonitor | None = None
        self.card_map: CardMap | None = None
        self.missing: dict[str, str] = {}
        # spillover_cards and spillover_remote_cards, by the server each entry names.
        self.cards: dict[str, set[str]] = {}
        self.selectors: dict[str, list[Matcher]] = {}
        self.hotplug: HotplugEvents | None = None
        self.sources: list[Source] = []
        self.remote: PrometheusSource | None = None
        self._udev: UdevObserver | None = None
        self._running = False

    def load(self, loader) -> None:
        add = loader.add_option
        add("spillover_watch", bool, True, "Watch GPU and system memory and hand off on pressure.")
        add("spillover_sources", str, ",".join(ALL), "Memory sources to use, comma-separated.")
        add("spillover_sysfs_root", str, "/sys", "Where sysfs is (a test tree elsewhere).")
        add("spillover_proc_root", str, "/proc", "Where procfs is (meminfo, fdinfo, sockets).")
        add(
            "spillover_interval_ms", int, 20,
            "Sampling interval while a card is near its lines (ten times this when all are far).",
        )  # fmt: skip
        add(
            "spillover_free_floor_mib", int, 0,
            "Hand off when a card has this little free (0: 3 percent of it, 512 MiB to "
            "2 GiB); a card with less than twice that free at rest (a model filling it) "
            "hands off once half of what it had free is taken.",
        )  # fmt: skip
        add(
            "spillover_step_mib", int, 1024,
            "Hand off on a jump in use this big within 250 ms that leaves at most the floor "
            "plus twice the jump free.",
        )  # fmt: skip
        add(
            "spillover_rearm_mib", int, 1024,
            "A card that fired is clear again once it has this much more than its floor "
            "free, or three quarters of what was taken back.",
        )  # fmt: skip
        add(
            "spillover_settle_s", int, 30,
            "A card whose memory has held still this long (within a quarter of "
            "spillover_step_mib) takes that as its rest: memory another program keeps, or a "
            "model reloaded behind an open port, stops being pressure, and the next step "
            "hands off again.",
        )  # fmt: skip
        add(
            "spillover_dwell_s", int, 30,
            "New requests return to a server only once its cards have been clear this long.",
        )  # fmt: skip
        add(
            "spillover_shadow_warn_mib", int, 4096,
            "With spillover_shadow=near: shadow an answer while a sudden allocation of this "
            "much or less would cross a line of its server's card.",
        )  # fmt: skip
        add(
            "spillover_cards", str, "",
            "Which cards each server uses, e.g. http://127.0.0.1:8081=nvml:0+nvml:1 "
            "(default: found from the server's process, or in spillover_prometheus for remote "
            "servers).",
        )  # fmt: skip

        add(
            "spillover_prometheus", str, "",
            "A Prometheus server to read the cards of servers on other hosts from "
            "(e.g. http://prometheus:9090): DCGM, AMD, node_exporter drm, XPU Manager or "
            "other spillover proxies' series.",
        )  # fmt: skip
        add(
            "spillover_prometheus_token", str, "",
            "A bearer token for spillover_prometheus, or @FILE to read it from.",
        )  # fmt: skip
        add(
            "spillover_prometheus_interval_ms", int, 1000,
            "How often spillover_prometheus is asked (one query each time).",
        )  # fmt: skip
        add(
            "spillover_remote_cards", str, "",
            'Which Prometheus series are a remote server\'s cards, e.g. '
            'http://10.0.0.2:8080={Hostname="gpu2",gpu="0"} (default: the series whose '
            "host labels name the server's host).",
        )  # fmt: skip

    def configure(self, updated: set[str]) -> None:
        named = self.cards, self.selectors
        # Servers named wrong are the Spillover addon's to say.
        if updated & (WATCH_OPTIONS | SERVER_OPTIONS) and not option_mistakes(ctx.options):
            try:
                named = self._named_cards()
            except ValueError as exc:
                if self._running:  # a change made in mitmweb's or the console's options
                    raise exceptions.OptionsError(str(exc)) from None
                refuse_at_start([str(exc)])  # one line, and mitmproxy exits 1
                return
        if "spillover_prometheus_token" in updated:
            read_secret(ctx.options.spillover_prometheus_token)  # an unreadable file: now
        changed, (self.cards, self.selectors) = named != (self.cards, self.selectors), named
        if self._running and (updated & WATCH_OPTIONS or changed):
            self._stop()
            self._start()

    def _named_cards(self) -> tuple[dict[str, set[str]], dict[str, list[Matcher]]]:
        """spillover_cards and spillover_remote_cards by the server each entry names
        (servers/keyed.py)."""
        options = ctx.options
        servers = keyed.configured_servers(options)
        return (
            keyed.by_server(keyed.CARDS, options.spillover_cards, servers),
            keyed.by_server(keyed.REMOTE_CARDS, options.spillover_remote_cards, servers),
        )

    def running(self) -> None:
        self._running = True
        self._start()
        if self.monitor is not None:
            refuse_at_start(self._unknown_cards())

    def _unknown_cards(self) -> list[str]:
        """The cards spillover_cards names that no source reports here (read once now)."""
        assert self.monitor is not None
        self.monitor.sample()
        return unknown_cards(self.cards, self.monitor.seen())

    def done(self) -> None:
        self._running = False
        self._stop()

    def _start(self) -> None:
        options = ctx.options
        if not options.spillover_watch:
            return
        names = [n.strip() for n in options.spillover_sources.split(",") if n.strip()]
        sources, self.missing = open_sources(
            names, Path(options.spillover_sysfs_root), Path(options.spillover_proc_root)
        )
        if options.spillover_prometheus:
            self.remote = PrometheusSource(
                options.spillover_prometheus,
                read_secret(options.spillover_prometheus_token) or None,
                options.spillover_prometheus_interval_ms / 1000,
            ).start()
            sources.append(self.remote)
        self.sources = sources
        for name, why in self.missing.items():
            log.info("memory source %s not used: %s", name, why)
        self.card_map = card_map(
            self.cards,
            sources,
            Path(options.spillover_proc_root),
            Path(options.spillover_sysfs_root),
            self.selectors,
        )
        lines = Lines(
            free_floor_mib=options.spillover_free_floor_mib,
            step_mib=options.spillover_step_mib,
            rearm_mib=options.spillover_rearm_mib,
            settle_s=options.spillover_settle_s,
        )
        card_map_now = self.card_map
        self.monitor = MemoryMonitor(
            sources,
            self._on_pressure,
            lines,
            interval=options.spillover_interval_ms / 1000,
            own_pids=lambda: card_map_now.server_pids(self.servers()),
        )
        self.hotplug = HotplugEvents(rescan=self.monitor.rescan, sample_now=self.monitor.wake)
        try:
            self._udev = UdevObserver(self.hotplug)
            self._udev.start()
        except NotApplicable as exc:
            self.missing["udev"] = str(exc)
        self.monitor.start()
        self.spillover.status_parts["memory"] = self.status
        self.spillover.fleet.router.memory = self.memory_of
        self.spillover.fleet.router.came_up = self.came_up
        self.spillover.fleet.shadows.near = self.near_of

    def _stop(self) -> None:
        if self._udev is not None:
            self._udev.stop()
            self._udev = None
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None
        if self.remote is not None:
            self.remote.stop()
            self.remote = None

    def servers(self) -> list[str]:
        return self.spillover.server_urls()

    def memory_of(self, server: str) -> tuple[str, str] | None:
        """("pressured" or "unknown", why) for a server's cards now, or None when they are
        clear (or nothing is watched). A remote server whose cards Prometheus has not
        shown is unknown."""
        if (watched := self._watched(server)) is None:
            return None
        monitor, mapping = watched
        cards = set(mapping.cards)
        if mapping.how == PROMETHEUS and not cards:
            return "unknown", f"unknown: {mapping.detail}"
        judged = monitor.judge(cards, time.monotonic(), ctx.options.spillover_dwell_s)
        if judged is None and mapping.how == PROMETHEUS and (unread := cards - monitor.seen()):
            return "unknown", f"{min(unread)}: unknown (no reading yet)"
        return judged

    def came_up(self, server: str, down_since: float) -> None:
        """A server came up after being down from `down_since`: the cards it is on hold
        their rest now (its model filling one is not pressure; memory taken after this
        is)."""
        if (watched := self._watched(server)) is not None:
            monitor, mapping = watched
            monitor.settle(set(mapping.cards), down_since)

    def near_of(self, server: str) -> bool:
        """Whether a server's cards are near their lines (shadow prefill starts)."""
        if (watched := self._watched(server)) is None:
            return False
        monitor, mapping = watched
        return monitor.near(set(mapping.cards), ctx.options.spillover_shadow_warn_mib)

    def _watched(self, server: str) -> tuple[MemoryMonitor, Mapping] | None:
        """The running monitor and how the server is mapped to its cards, or None while
        nothing is watched."""
        monitor, card_map = self.monitor, self.card_map
        if monitor is None or card_map is None:
            return None
        return monitor, card_map.mapping_of(server)

    def _on_pressure(self, crossing: Crossing) -> None:
        """Runs on the monitor thread."""
        assert self.card_map is not None
        card = crossing.card
        servers = self.card_map.servers_on(card, self.servers())
        if servers:
            self.spillover.request_handoff(
                f"memory pressure on {card}: {crossing.line}",
                servers,
                Sensed(crossing.crossed, crossing.last_below),
            )
        else:
            log.info("pressure on %s, which none of the servers uses: %s", card, crossing.line)

    def _name_holders(self, cards: dict) -> None:
        """Each process holding a card's memory (where its source says) with its name,
        and whether it is one of the servers'."""
        if self.card_map is None or not any(c.get("holders") for c in cards.values()):
            return
        proc = Path(ctx.options.spillover_proc_root)
        own = self.card_map.server_pids(self.servers())
        for card in cards.values():
            for holder in card.get("holders") or ():
                try:
                    holder["name"] = (proc / str(holder["pid"]) / "comm").read_text().strip()
                except OSError:
                    holder["name"] = "?"
                holder["server"] = holder["pid"] in own

    def status(self) -> dict:
        monitor = self.monitor
        state = monitor.status() if monitor else {"alive": False}
        self._name_holders(state.get("cards", {}))
        for source in self.sources:
            for card, reserved in getattr(source, "reserved_mib", {}).items():
                if card in state.get("cards", {}) and reserved >= 0:
                    state["cards"][card]["reserved_mib"] = round(reserved, 1)
        return {
            **state,
            "hotplug": {
                "events": dict(self.hotplug.handled) if self.hotplug else {},
                "from": self._udev.source if self._udev else self.missing.get("udev"),
            },
            "not_used": self.missing,
            "prometheus": self.remote.status() if self.remote else None,
            "servers": {
                s: self.card_map.mapping_of(s).status() for s in self.servers()
            } if self.card_map else {},
        }  # fmt: skip
