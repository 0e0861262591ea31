"""Open the memory sources asked for, and say plainly why each one that is missing is."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from watchers.fdinfo import FdinfoSource
from watchers.meminfo import MeminfoSource
from watchers.nvml import NvmlSource
from watchers.reading import NotApplicable, Source
from watchers.sysfs import SysfsVramSource

ALL = ("nvml", "sysfs", "fdinfo", "meminfo")


def open_sources(
    names: Iterable[str], sysfs_root: Path = Path("/sys"), proc_root: Path = Path("/proc")
) -> tuple[list[Source], dict[str, str]]:
    """(sources that apply here, {name: why not} for the others)."""
    factories = {
        "nvml": NvmlSource,
        "sysfs": lambda: SysfsVramSource(sysfs_root),
        "fdinfo": lambda: FdinfoSource(proc_root, sysfs_root),
        "meminfo": lambda: MeminfoSource(proc_root / "meminfo"),
    }
    sources: list[Source] = []
    missing: dict[str, str] = {}
    for name in names:
        if name not in factories:
            missing[name] = f"unknown source (known: {', '.join(ALL)})"
            continue
        try:
            sources.append(factories[name]())
        except NotApplicable as exc:
            missing[name] = str(exc)
    return sources, missing


def gpu_pids(sources: Iterable[Source]) -> dict[int, set[str]]:
    """pid -> GPU cards it holds memory on, from every source that can tell."""
    held: dict[int, set[str]] = {}
    for source in sources:
        if isinstance(source, NvmlSource):
            for pid, cards in source.processes().items():
                held.setdefault(pid, set()).update(cards)
        elif isinstance(source, FdinfoSource):
            for card, pids in source.pids.items():
                for pid in pids:
                    held.setdefault(pid, set()).add(card)
    return held
