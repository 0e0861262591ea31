"""Hotplug through udev (pyudev): cards that appear, go or reset are picked up without a
restart. AMD and Intel cards announce themselves as DRM devices; an NVIDIA card often
shows up only as a PCI device (driver nvidia, no DRM node), so both subsystems are
followed: an add, remove, bind or unbind of a display-class PCI device makes every
source look again (NVML is re-initialised), a DRM change event samples at once."""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from watchers.reading import NotApplicable

log = logging.getLogger(__name__)
GPU_DRIVERS = {"nvidia", "amdgpu", "radeon", "i915", "xe", "nouveau"}
RESCAN_ACTIONS = {"add", "remove", "bind", "unbind"}
UDEV_DAEMON = Path("/run/udev/control")


def is_display_class(pci_class: str) -> bool:
    """PCI class 0x03xxxx: VGA, XGA and 3D controllers (datacenter GPUs are 0x0302)."""
    try:
        return int(pci_class, 16) >> 16 == 0x03
    except ValueError:
        return False


class HotplugEvents:
    """Turns udev events into rescans and immediate samples."""

    def __init__(self, rescan: Callable[[], None], sample_now: Callable[[], None]) -> None:
        self._rescan = rescan
        self._sample_now = sample_now
        self.handled: Counter[str] = Counter()  # "pci add", "drm change", ...

    def handle(
        self, subsystem: str, action: str, sys_name: str, properties: Mapping[str, str]
    ) -> None:
        """One udev event; `properties` are its environment (DRIVER, PCI_CLASS, ...)."""
        if subsystem == "drm":
            if not sys_name.startswith("card") or "-" in sys_name:
                return  # connectors (card0-DP-1) and render nodes carry no memory counters
        elif subsystem == "pci":
            gpu = properties.get("DRIVER") in GPU_DRIVERS
            if not (gpu or is_display_class(properties.get("PCI_CLASS", ""))):
                return
        else:
            return
        self.handled[f"{subsystem} {action}"] += 1
        if action in RESCAN_ACTIONS:
            self._rescan()
        else:
            self._sample_now()


class UdevObserver:
    """Follows the kernel's DRM and PCI events on a pyudev monitor thread: through the
    udev daemon where one runs, else straight from the kernel."""

    def __init__(self, events: HotplugEvents) -> None:
        self.source = "udev" if UDEV_DAEMON.exists() else "kernel"
        try:
            import pyudev

            context = pyudev.Context()
            monitor = pyudev.Monitor.from_netlink(context, source=self.source)
            monitor.filter_by("drm")
            monitor.filter_by("pci")
            self._observer = pyudev.MonitorObserver(
                monitor,
                callback=lambda device: events.handle(
                    device.subsystem or "", device.action or "", device.sys_name,
                    dict(device.properties),
                ),
            )  # fmt: skip
        except (ImportError, OSError) as exc:
            raise NotApplicable(
                f"udev events unavailable ({exc!r}): cards are found at start only"
            ) from None
        self._observer.daemon = True

    def start(self) -> None:
        self._observer.start()

    def stop(self) -> None:
        self._observer.send_stop()


@dataclass(frozen=True)
class PciCard:
    address: str  # 0000:17:00.0
    driver: str | None
    drm: bool  # has DRM nodes (cardN, renderDN)


def pci_cards(sysfs_root: Path) -> list[PciCard]:
    """Display-class PCI devices, as the kernel lists them."""
    devices = sysfs_root / "bus" / "pci" / "devices"
    found = []
    for device in sorted(devices.iterdir()) if devices.is_dir() else ():
        try:
            if not is_display_class((device / "class").read_text().strip()):
                continue
        except OSError:
            continue
        driver = device / "driver"
        name = os.path.basename(os.readlink(driver)) if driver.is_symlink() else None
        found.append(PciCard(device.name, name, (device / "drm").is_dir()))
    return found


def what_is_seen(cards: list[PciCard], observer: UdevObserver | str) -> list[str]:
    """In plain words, which card changes this machine will signal (the doctor says it).
    `observer`: a working observer, or why there is none."""
    if isinstance(observer, str):
        return [f"no hotplug events ({observer}); a card added later needs a restart"]
    lines = []
    if observer.source == "kernel":
        lines.append(
            f"no udev daemon ({UDEV_DAEMON} missing): listening to the kernel's own events, "
            "which do not reach a container in its own network namespace"
        )
    for card in cards:
        driver = card.driver or "no driver bound"
        if card.drm:
            lines.append(
                f"{card.address} ({driver}): added/removed seen (pci, drm); "
                "a DRM change event samples at once"
            )
        else:
            lines.append(
                f"{card.address} ({driver}): added/removed seen as a PCI device only "
                "(no DRM node); memory use is sampled, never signalled"
            )
    if not cards:
        lines.append("no display-class PCI device here: a GPU added later is seen when it appears")
    return lines
