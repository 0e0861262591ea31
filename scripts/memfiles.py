"""Trees of real files standing in for sysfs and procfs, written and changed by tests,
the demo and the benchmarks."""

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
        write_in_place(self.device / "mem_info_vram_used", f"{used_mib * MIB:>20}\n")


def write_meminfo(path: Path, total_mib: int, available_mib: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_in_place(
        path,
        f"MemTotal:       {total_mib * 1024:>12} kB\n"
        f"MemFree:        {available_mib * 1024:>12} kB\n"
        f"MemAvailable:   {available_mib * 1024:>12} kB\n"
        f"Buffers:                   0 kB\n",
    )


def write_in_place(path: Path, text: str) -> None:
    """One pwrite of a fixed-width value, as the kernel's files never change inode: the
    watchers keep them open and re-read from offset 0."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, text.encode(), 0)
    finally:
        os.close(fd)


def mem_available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no MemAvailable")
