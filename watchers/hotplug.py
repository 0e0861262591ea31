"""DRM hotplug through udev (pyudev): cards that appear, go or reset are picked up without
a restart, and a change event samples at once."""

from __future__ import annotations

import logging
from collections.abc import Callable

from watchers.reading import NotApplicable
from watchers.sysfs import card_id

log = logging.getLogger(__name__)


class DrmEvents:
    """Turns udev events for DRM cards into rescans, forgets and immediate samples."""

    def __init__(
        self,
        rescan: Callable[[], None],
        forget: Callable[[str], None],
        sample_now: Callable[[], None],
    ) -> None:
        self._rescan = rescan
        self._forget = forget
        self._sample_now = sample_now
        self.handled = 0

    def handle(self, action: str, sys_name: str) -> None:
        """One udev event: `action` is add/remove/change, `sys_name` e.g. "card1"."""
        if not sys_name.startswith("card") or "-" in sys_name:
            return  # connectors (card0-DP-1) and render nodes carry no memory counters
        self.handled += 1
        if action in ("add", "remove", "change"):
            self._rescan()
        if action == "remove":
            self._forget(card_id(sys_name))
        self._sample_now()


class UdevObserver:
    """Follows the kernel's DRM events on a pyudev monitor thread."""

    def __init__(self, events: DrmEvents) -> None:
        try:
            import pyudev

            context = pyudev.Context()
            monitor = pyudev.Monitor.from_netlink(context)
            monitor.filter_by("drm")
            self._observer = pyudev.MonitorObserver(
                monitor, callback=lambda device: events.handle(device.action, device.sys_name)
            )
        except (ImportError, OSError) as exc:
            raise NotApplicable(
                f"udev events unavailable ({exc!r}): cards are scanned at start only"
            ) from None
        self._observer.daemon = True

    def start(self) -> None:
        self._observer.start()

    def stop(self) -> None:
        self._observer.send_stop()
