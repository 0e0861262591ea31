"""The fleet's memory series as Prometheus holds them: which exporter names what, and how
its series become one remote card each (`prom:<host>:<gpu>`).

A card's used series is joined with its total (or free) series by their labels, which
the exporters give both alike; the host is what the exporter says (DCGM's `Hostname`,
a spillover proxy's `host`) or, failing that, the scraped target (`instance`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from watchers.reading import MIB


@dataclass(frozen=True)
class Family:
    exporter: str
    used: str
    total: str | None = None
    free: str | None = None  # where the exporter gives free, not total (DCGM)
    mib_per_unit: float = 1.0
    gpu_labels: tuple[str, ...] = ("gpu",)


FAMILIES = (
    Family("dcgm", "DCGM_FI_DEV_FB_USED", free="DCGM_FI_DEV_FB_FREE", gpu_labels=("gpu", "UUID")),
    Family("amd", "gpu_used_vram", total="gpu_total_vram", gpu_labels=("gpu_id", "card_id")),
    Family(
        "node-drm",
        "node_drm_memory_vram_used_bytes",
        total="node_drm_memory_vram_size_bytes",
        mib_per_unit=1 / MIB,
        gpu_labels=("card",),
    ),
    Family("xpum", "xpum_memory_used_bytes", mib_per_unit=1 / MIB, gpu_labels=("dev_id",)),
    Family(
        "spillover",
        "spillover_card_used_mib",
        total="spillover_card_total_mib",
        gpu_labels=("card",),
    ),
)
NAMES = sorted({n for f in FAMILIES for n in (f.used, f.total, f.free) if n is not None})
HOST_LABELS = ("host", "Hostname", "hostname", "instance")
REMOTE_PREFIX = "prom:"


@dataclass(frozen=True)
class Series:
    labels: Mapping[str, str]  # with __name__
    time: float  # the last sample's time (Unix seconds, Prometheus's clock)
    value: float
    spacing_s: float | None  # between its last two samples: the scrape interval


@dataclass(frozen=True)
class RemoteCard:
    card: str  # prom:<host>:<gpu>
    exporter: str
    hosts: frozenset[str]  # every name of its host the labels give
    labels: Mapping[str, str]  # its used series' labels
    used_mib: float
    total_mib: float | None
    time: float  # when its used series was last scraped (Unix seconds)
    spacing_s: float | None


def series_of(result: Iterable[Mapping]) -> list[Series]:
    """The series of a range-vector answer (`"resultType": "matrix"`)."""
    found = []
    for entry in result:
        values = entry["values"]
        if not values:
            continue
        spacing = float(values[-1][0]) - float(values[-2][0]) if len(values) > 1 else None
        found.append(Series(entry["metric"], float(values[-1][0]), float(values[-1][1]), spacing))
    return found


def host_of(labels: Mapping[str, str]) -> str | None:
    for label in HOST_LABELS:
        if value := labels.get(label):
            return _without_port(value) if label == "instance" else value
    return None


def cards_of(series: Iterable[Series]) -> dict[str, RemoteCard]:
    """One card per used series that names a host; its total from the series beside it."""
    by_name = {f.used: f for f in FAMILIES}
    others: dict[tuple[str, frozenset], Series] = {}
    used: list[tuple[Family, Series]] = []
    for one in series:
        name = one.labels.get("__name__", "")
        if name in by_name:
            used.append((by_name[name], one))
        else:
            others[(name, _join_key(one.labels))] = one
    cards: dict[str, RemoteCard] = {}
    for family, one in used:
        host = host_of(one.labels)
        if host is None:
            continue
        gpu = next((one.labels[g] for g in family.gpu_labels if one.labels.get(g)), "0")
        key = _join_key(one.labels)
        used_mib = one.value * family.mib_per_unit
        total_mib = None
        if family.total and (total := others.get((family.total, key))) is not None:
            total_mib = total.value * family.mib_per_unit
        elif family.free and (free := others.get((family.free, key))) is not None:
            total_mib = used_mib + free.value * family.mib_per_unit
        card = f"{REMOTE_PREFIX}{host}:{gpu}"
        hosts = {host_of({label: v}) for label in HOST_LABELS if (v := one.labels.get(label))}
        cards[card] = RemoteCard(
            card,
            family.exporter,
            frozenset(hosts),
            one.labels,
            used_mib,
            total_mib,
            one.time,
            one.spacing_s,
        )
    return cards


def query() -> str:
    """The one selector that finds every family's series (ranged by the caller)."""
    return '{__name__=~"' + "|".join(NAMES) + '"}'


def _join_key(labels: Mapping[str, str]) -> frozenset:
    return frozenset((k, v) for k, v in labels.items() if k != "__name__")


def _without_port(instance: str) -> str:
    if instance.startswith("["):  # [::1]:9100
        return instance[1 : instance.find("]")]
    host, sep, port = instance.rpartition(":")
    return host if sep and port.isdigit() else instance
