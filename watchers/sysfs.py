"""DRM cards through sysfs: amdgpu's mem_info_vram_used/_total, and any other driver that
exposes the same files. The root is configurable so tests and the demo can point the real
reader at a tree of real files."""

from __future__ import annotations

import time
from pathlib import Path

from watchers.files import KernelFile
from watchers.reading import MIB, CardFailure, NotApplicable, Reading


def card_id(name: str) -> str:
    return f"drm:{name}"


def drm_cards(sysfs_root: Path) -> list[Path]:
    """cardN directories (not connectors such as card0-DP-1)."""
    drm = sysfs_root / "class" / "drm"
    if not drm.is_dir():
        return []
    return sorted(p for p in drm.iterdir() if p.name.startswith("card") and "-" not in p.name)


class SysfsVramSource:
    name = "sysfs"

    def __init__(self, sysfs_root: Path = Path("/sys")) -> None:
        self.root = sysfs_root
        self.cards: dict[str, tuple[KernelFile, float]] = {}  # card -> (used file, total MiB)
        self.rescan()
        if not (sysfs_root / "class" / "drm").is_dir():
            raise NotApplicable(f"no {sysfs_root}/class/drm: this machine shows no DRM devices")

    def rescan(self) -> None:
        """Pick up cards that appeared or went (called at start and on udev events)."""
        cards: dict[str, tuple[KernelFile, float]] = {}
        for card in drm_cards(self.root):
            device = card / "device"
            try:
                used = KernelFile(device / "mem_info_vram_used")
                total = int((device / "mem_info_vram_total").read_text()) / MIB
            except (OSError, ValueError):
                continue  # not a card with VRAM counters (or it went away meanwhile)
            cards[card_id(card.name)] = (used, total)
        self.cards = cards

    def read(self) -> list[Reading | CardFailure]:
        readings: list[Reading | CardFailure] = []
        for card, (used_file, total) in list(self.cards.items()):
            try:
                used = int(used_file.read(64))
            except (OSError, ValueError) as exc:
                readings.append(CardFailure(card, repr(exc)))
                continue
            readings.append(Reading(card, used / MIB, total, time.monotonic()))
        return readings
