"""Open the memory sources asked for, and say plainly why each one that is missing is."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from watchers.fdinfo import FdinfoSource
from watchers.gates import DRM_FDINFO, NVML_PROCESSES, CardMap, PidCards
from watchers.meminfo import MeminfoSource
from watchers.nvml import NvmlSource
from watchers.prometheus import Matcher, PrometheusSource, remote_mapping
from watchers.reading import NotApplicable, Source
from watchers.sysfs import SysfsVramSource

ALL = ("nvml", "sysfs", "fdinfo", "meminfo")


def open_sources(
    names: Iterable[str],
    sysfs_root: Path = Path("/sys"),
    proc_root: Path = Path("/proc"),
    dev_root: Path = Path("/dev"),
) -> tuple[list[Source], dict[str, str]]:
    """(sources that apply here, {name: why not} for the others)."""
    factories = {
        "nvml": NvmlSource,
        "sysfs": lambda: SysfsVramSource(sysfs_root),
        "fdinfo": lambda: FdinfoSource(proc_root, sysfs_root, dev_root),
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


def gpu_pids(sources: Iterable[Source]) -> PidCards:
    """pid -> GPU cards it holds memory on, from every source that can tell (and which)."""
    held = PidCards()
    for source in sources:
        if isinstance(source, FdinfoSource) and not source.tried:
            held.complete = False
        if isinstance(source, NvmlSource):
            for pid, cards in source.processes().items():
                held.add(pid, cards, NVML_PROCESSES)
        elif isinstance(source, FdinfoSource):
            for card, pids in source.pids.items():
                for pid in pids:
                    held.add(pid, {card}, DRM_FDINFO)
    return held


def nvml_minors(sources: Iterable[Source]) -> dict[int, str]:
    """/dev/nvidia<N> minor number -> NVML card, for mapping servers by their device files."""
    minors: dict[int, str] = {}
    for source in sources:
        if isinstance(source, NvmlSource):
            minors.update(source.minor_numbers())
    return minors


def card_map(
    explicit: dict[str, set[str]],
    sources: list[Source],
    proc_root: Path,
    sysfs_root: Path,
    selectors: dict[str, list[Matcher]] | None = None,
) -> CardMap:
    """Which cards each server uses, found with every source that can tell (remote ones
    through a Prometheus source, by `selectors` or by host)."""
    remote = next((s for s in sources if isinstance(s, PrometheusSource)), None)
    chosen = selectors or {}
    return CardMap(
        explicit,
        lambda: gpu_pids(sources),
        proc_root,
        sysfs=sysfs_root,
        minors=lambda: nvml_minors(sources),
        remote=None
        if remote is None
        else lambda server: remote_mapping(remote, server, chosen.get(server)),
    )
