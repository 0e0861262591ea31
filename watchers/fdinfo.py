"""DRM cards through the per-process fdinfo counters of the DRM usage-stats format
(Intel xe/i915 and other drivers that expose no VRAM files in sysfs). Used memory per
card is the sum over its clients; the total comes from sysfs where present. For i915 and
xe the total comes from the driver's memory-region query (watchers/regions.py), and so
does a card-wide used figure where the driver gives one (CAP_PERFMON)."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

from watchers.reading import MIB, CardFailure, NotApplicable, Reading
from watchers.regions import (
    FDINFO_SUM,
    CardMemory,
    Query,
    ask_driver,
    card_memory,
    driver_of,
    has_perfmon,
)
from watchers.sysfs import card_id, drm_cards

HOST_REGIONS = {"system", "gtt", "cpu", "stolen-system"}
UNITS = {"": 1, "KiB": 1024, "MiB": MIB, "GiB": 1024 * MIB}
RESCAN_SECONDS = 5.0  # finding DRM file descriptors walks every process: not every sample
INTEL = {"i915", "xe"}  # drivers asked for their memory regions


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

    def __init__(
        self,
        proc_root: Path = Path("/proc"),
        sysfs_root: Path = Path("/sys"),
        dev_root: Path = Path("/dev"),
        query: Query = ask_driver,
    ) -> None:
        if not (sysfs_root / "class" / "drm").is_dir():
            raise NotApplicable(f"no {sysfs_root}/class/drm: this machine shows no DRM devices")
        self.proc = proc_root
        self.sys = sysfs_root
        self.dev = dev_root
        self.query = query
        self._files: list[Path] = []
        self._scanned_at = float("-inf")
        # pdev -> (card, its sysfs dir, driver, regions at the last rescan), for i915 and xe
        self._intel: dict[str, tuple[str, Path, str, CardMemory]] = {}
        self.pids: dict[str, set[int]] = {}  # card -> pids holding it, from the last read
        self.measured: dict[str, str] = {}  # card -> how its used figure was measured
        # Read at least once, whatever came of it: until then `pids` knows no one.
        self.tried = False

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
        privileged = has_perfmon(self.proc)
        self._intel = {}
        for pdev, (card, card_dir) in self._cards_by_pdev().items():
            if (driver := driver_of(card_dir)) in INTEL:
                memory = card_memory(card_dir, driver, privileged, self.dev, self.query)
                self._intel[pdev] = (card, card_dir, driver, memory)

    def _intel_reading(self, pdev: str, clients: dict[str, int]) -> tuple[Reading | None, str]:
        """An i915/xe card: card-wide where the driver gives that (asked again each read:
        use changes), else the fdinfo sum; the total from the regions of the last rescan."""
        card, card_dir, driver, memory = self._intel[pdev]
        if memory.used_mib is not None:
            fresh = card_memory(card_dir, driver, True, self.dev, self.query)
            memory = fresh if fresh.used_mib is not None else replace(memory, used_mib=None)
            memory = replace(memory, how=fresh.how)
        if memory.total_mib is None and not clients:
            return None, memory.how  # nothing known of a card no process holds
        used = sum(clients.values()) / MIB if memory.used_mib is None else memory.used_mib
        return Reading(card, used, memory.total_mib, time.monotonic()), memory.how

    def _cards_by_pdev(self) -> dict[str, tuple[str, Path]]:
        return {
            os.path.basename(os.path.realpath(card / "device")): (card_id(card.name), card)
            for card in drm_cards(self.sys)
        }

    def read(self) -> list[Reading | CardFailure]:
        try:
            return self._read()
        finally:
            self.tried = True

    def _read(self) -> list[Reading | CardFailure]:
        if time.monotonic() - self._scanned_at > RESCAN_SECONDS:
            self.rescan()
        used: dict[str, dict[str, int]] = {}
        pids: dict[str, set[int]] = {}
        held: dict[str, dict[int, int]] = {}  # pdev -> pid -> bytes, each client counted once
        for path in self._files:
            try:
                parsed = parse_fdinfo(path.read_text())
            except (OSError, ValueError):
                continue
            if parsed is None:
                continue
            pdev, client, local = parsed
            pid = int(path.parent.parent.name)
            key = client or str(path)
            if key not in used.setdefault(pdev, {}):
                by_pid = held.setdefault(pdev, {})
                by_pid[pid] = by_pid.get(pid, 0) + local
            used[pdev][key] = local
            pids.setdefault(pdev, set()).add(pid)
        cards = self._cards_by_pdev()
        readings: list[Reading | CardFailure] = []
        # Filled here and given whole: the card map reads them from another thread.
        by_card: dict[str, set[int]] = {}
        measured: dict[str, str] = {}
        for pdev in [*used, *(pdev for pdev in self._intel if pdev not in used)]:
            clients = used.get(pdev, {})
            if pdev in self._intel:
                reading, how = self._intel_reading(pdev, clients)
                if reading is None:
                    continue
            else:
                card, card_dir = cards.get(pdev, (f"pdev:{pdev}", None))
                total = None
                if card_dir is not None and (card_dir / "device" / "mem_info_vram_total").exists():
                    total = int((card_dir / "device" / "mem_info_vram_total").read_text()) / MIB
                reading = Reading(card, sum(clients.values()) / MIB, total, time.monotonic())
                how = FDINFO_SUM
            clients_of = held.get(pdev, {})
            reading = replace(
                reading, held=tuple((pid, b / MIB) for pid, b in sorted(clients_of.items()))
            )
            readings.append(reading)
            measured[reading.card] = how
            if pdev in pids:
                by_card[reading.card] = pids[pdev]
        self.pids, self.measured = by_card, measured
        return readings
