"""DRM cards through the per-process fdinfo counters of the DRM usage-stats format
(Intel xe/i915 and other drivers that expose no VRAM files in sysfs). Used memory per
card is the sum over its clients; the total comes from sysfs where present."""

from __future__ import annotations

import os
import time
from pathlib import Path

from watchers.reading import MIB, CardFailure, NotApplicable, Reading
from watchers.sysfs import card_id, drm_cards

HOST_REGIONS = {"system", "gtt", "cpu", "stolen-system"}
UNITS = {"": 1, "KiB": 1024, "MiB": MIB, "GiB": 1024 * MIB}
RESCAN_SECONDS = 5.0  # finding DRM file descriptors walks every process: not every sample


def parse_fdinfo(text: str) -> tuple[str, str, int] | None:
    """(pdev, client id, device-local bytes) of a DRM fdinfo file, None for other fds."""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    pdev = fields.get("drm-pdev", "").strip()
    if not pdev:
        return None
    local = 0
    for key, value in fields.items():
        for prefix in ("drm-resident-", "drm-memory-"):
            if key.startswith(prefix) and key[len(prefix) :] not in HOST_REGIONS:
                number, _, unit = value.strip().partition(" ")
                local += int(number) * UNITS.get(unit.strip(), 1)
    return pdev, fields.get("drm-client-id", "").strip(), local


class FdinfoSource:
    name = "fdinfo"

    def __init__(self, proc_root: Path = Path("/proc"), sysfs_root: Path = Path("/sys")) -> None:
        if not (sysfs_root / "class" / "drm").is_dir():
            raise NotApplicable(f"no {sysfs_root}/class/drm: this machine shows no DRM devices")
        self.proc = proc_root
        self.sys = sysfs_root
        self._files: list[Path] = []
        self._scanned_at = float("-inf")
        self.pids: dict[str, set[int]] = {}  # card -> pids holding it, from the last read

    def rescan(self) -> None:
        files = []
        for pid in (p for p in self.proc.iterdir() if p.name.isdigit()):
            try:
                for fd in (pid / "fd").iterdir():
                    if os.readlink(fd).startswith("/dev/dri/"):
                        files.append(pid / "fdinfo" / fd.name)
            except OSError:
                continue  # the process went, or is not ours to look at
        self._files = files
        self._scanned_at = time.monotonic()

    def _cards_by_pdev(self) -> dict[str, tuple[str, Path]]:
        return {
            os.path.basename(os.path.realpath(card / "device")): (card_id(card.name), card)
            for card in drm_cards(self.sys)
        }

    def read(self) -> list[Reading | CardFailure]:
        if time.monotonic() - self._scanned_at > RESCAN_SECONDS:
            self.rescan()
        used: dict[str, dict[str, int]] = {}
        pids: dict[str, set[int]] = {}
        for path in self._files:
            try:
                parsed = parse_fdinfo(path.read_text())
            except (OSError, ValueError):
                continue
            if parsed is None:
                continue
            pdev, client, local = parsed
            used.setdefault(pdev, {})[client or str(path)] = local
            pids.setdefault(pdev, set()).add(int(path.parent.parent.name))
        cards = self._cards_by_pdev()
        readings: list[Reading | CardFailure] = []
        self.pids = {}
        for pdev, clients in used.items():
            card, card_dir = cards.get(pdev, (f"pdev:{pdev}", None))
            total = None
            if card_dir is not None and (card_dir / "device" / "mem_info_vram_total").exists():
                total = int((card_dir / "device" / "mem_info_vram_total").read_text()) / MIB
            self.pids[card] = pids[pdev]
            readings.append(Reading(card, sum(clients.values()) / MIB, total, time.monotonic()))
        return readings
