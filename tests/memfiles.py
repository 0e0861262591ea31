"""Trees of real files standing in for sysfs and procfs, written and changed by tests."""

from __future__ import annotations

import os
from pathlib import Path

MIB = 1024 * 1024


class FakeCard:
    """/sys/class/drm/cardN with amdgpu's VRAM counters (in bytes, as the kernel writes)."""

    def __init__(
        self, sysfs: Path, name: str, total_mib: int, used_mib: int, pdev: str = ""
    ) -> None:
        self.name = name
        pci = sysfs / "devices" / (pdev or f"0000:0{name[-1]}:00.0")
        pci.mkdir(parents=True, exist_ok=True)
        card = sysfs / "class" / "drm" / name
        card.mkdir(parents=True, exist_ok=True)
        (card / "device").symlink_to(pci)
        self.device = pci
        (pci / "mem_info_vram_total").write_text(f"{total_mib * MIB}\n")
        self.set_used(used_mib)

    def set_used(self, used_mib: int) -> None:
        # Write then rename, as a reader must never see a half-written number.
        tmp = self.device / ".mem_info_vram_used"
        tmp.write_text(f"{used_mib * MIB}\n")
        os.replace(tmp, self.device / "mem_info_vram_used")


def write_meminfo(path: Path, total_mib: int, available_mib: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        f"MemTotal:       {total_mib * 1024} kB\nMemFree:        {available_mib * 1024} kB\n"
        f"MemAvailable:   {available_mib * 1024} kB\nBuffers:        0 kB\n"
    )
    os.replace(tmp, path)


def mem_available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no MemAvailable")
