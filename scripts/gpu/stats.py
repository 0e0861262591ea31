"""Numbers for the GPU proof (`scripts/gpu/proof.py`): per-run results, their summary,
the table it prints, and what it reads back from the addon (a Prometheus histogram, the
`*_ms` fields of each handoff in the recorded flows)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RunResult:
    """One answer streamed through the proxy while the step was allocated mid-answer.
    Times are time.monotonic() seconds (one clock for every process on the machine)."""

    index: int
    clean: bool  # one continued answer: one finish, one [DONE], one pressure handoff note
    why: str  # what was wrong, when not clean
    tokens: int = 0
    kind: str = "step"  # what took the memory: a step (torch, a file card) or a loading server
    note: str | None = None
    alloc_start: float | None = None  # just before torch.empty (a loader: its start)
    alloc_done: float | None = None  # ... just after it and cuda synchronize returned
    nvml_seen: float | None = None  # NVML first showed the memory taken
    note_at: float | None = None  # the handoff note reached the client
    fallback_at: float | None = None  # the first fallback content chunk reached the client

    def _ms(self, start: float | None, end: float | None) -> float | None:
        return None if start is None or end is None else round((end - start) * 1000, 3)

    @property
    def alloc_ms(self) -> float | None:
        return self._ms(self.alloc_start, self.alloc_done)

    @property
    def alloc_to_note_ms(self) -> float | None:
        return self._ms(self.alloc_done, self.note_at)

    @property
    def note_to_fallback_ms(self) -> float | None:
        return self._ms(self.note_at, self.fallback_at)

    @property
    def nvml_lag_ms(self) -> float | None:
        return self._ms(self.alloc_done, self.nvml_seen)

    def as_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "alloc_ms": self.alloc_ms,
            "alloc_to_note_ms": self.alloc_to_note_ms,
            "note_to_fallback_ms": self.note_to_fallback_ms,
            "nvml_lag_ms": self.nvml_lag_ms,
        }


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the closest ranks (numpy's default)."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def spread(values: Iterable[float | None]) -> dict[str, float] | None:
    """p50, p95, max and how many, of the values that were measured."""
    measured = [v for v in values if v is not None]
    if not measured:
        return None
    return {
        "n": len(measured),
        "p50": round(percentile(measured, 50), 3),
        "p95": round(percentile(measured, 95), 3),
        "max": round(max(measured), 3),
    }


def run_figures(runs: list[RunResult]) -> dict[str, Any]:
    clean = [r for r in runs if r.clean]
    return {
        "runs": len(runs),
        "clean_handoffs": len(clean),
        "alloc_to_note_ms": spread(r.alloc_to_note_ms for r in clean),
        "note_to_fallback_ms": spread(r.note_to_fallback_ms for r in clean),
        "alloc_ms": spread(r.alloc_ms for r in runs),
        "nvml_lag_ms": spread(r.nvml_lag_ms for r in runs),
    }


@dataclass
class Summary:
    runs: list[RunResult] = field(default_factory=list)
    gpu: dict[str, Any] = field(default_factory=dict)  # name, total_mib, driver, arch
    build_s: float | None = None  # None: the binary came from the cache
    nvml_read_us: dict[str, float] = field(default_factory=dict)  # per query kind
    detection: dict[str, Any] | None = None  # the addon's histogram, if it has one
    handoff_ms_fields: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # plan, mapping, doctor, errors

    def figures(self) -> dict[str, Any]:
        kinds = sorted({r.kind for r in self.runs})
        return {
            **run_figures(self.runs),
            "handoff_fields_ms": {
                name: spread(values) for name, values in sorted(self.handoff_ms_fields.items())
            },
            "by_kind": {k: run_figures([r for r in self.runs if r.kind == k]) for k in kinds},
        }

    def as_json(self) -> dict[str, Any]:
        return {
            **self.figures(),
            "build_s": self.build_s,
            "build": "cached" if self.build_s is None else f"{self.build_s:.0f} s",
            "gpu": self.gpu,
            "nvml_read_us": self.nvml_read_us,
            "pressure_detection_seconds": self.detection,
            "per_run": [r.as_json() for r in self.runs],
            **self.extra,
        }


def _fmt(stats: dict[str, float] | None, keys: Sequence[str]) -> str:
    if stats is None:
        return "(none measured)"
    return "  ".join(f"{k} {stats[k]:.1f}" for k in keys)


def format_table(summary: Summary) -> str:
    f = summary.figures()
    gpu = summary.gpu
    rows = [
        ("GPU", f"{gpu.get('name', '?')}, {gpu.get('total_mib', '?')} MiB, driver "
                f"{gpu.get('driver', '?')}, sm_{gpu.get('arch', '?')}"),
        ("llama-server CUDA build", "cached" if summary.build_s is None
                                    else f"{summary.build_s:.0f} s"),
        ("runs", str(f["runs"])),
        *_run_rows(f, ""),
        *(row for kind, per in f["by_kind"].items() if len(f["by_kind"]) > 1
          for row in _run_rows(per, f" ({kind})")),
        ("NVML memory read us", ", ".join(
            f"{kind} {us:.1f}" for kind, us in summary.nvml_read_us.items()) or "(not measured)"),
    ]  # fmt: skip
    detection = summary.detection
    if detection is None:
        rows.append(("addon detection histogram", "(not served by this addon)"))
    elif detection.get("count"):
        mean_ms = detection["sum"] / detection["count"] * 1000
        rows.append(
            (
                "addon detection histogram",
                f"count {detection['count']:.0f}, sum {detection['sum']:.3f} s, "
                f"mean {mean_ms:.1f} ms",
            )
        )
        rows.append(("  buckets (le s: count)", _buckets(detection["buckets"])))
    else:
        rows.append(("addon detection histogram", "count 0"))
    for name, stats in f["handoff_fields_ms"].items():
        rows.append((f"handoff {name}", _fmt(stats, ("p50", "p95", "max"))))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _run_rows(f: dict[str, Any], kind: str) -> list[tuple[str, str]]:
    return [
        (f"clean handoffs{kind}", f"{f['clean_handoffs']} of {f['runs']}"),
        (f"allocation -> note ms{kind}", _fmt(f["alloc_to_note_ms"], ("p50", "p95", "max"))),
        (f"note -> first fallback chunk ms{kind}", _fmt(f["note_to_fallback_ms"], ("p50", "max"))),
        (f"allocation itself ms{kind}", _fmt(f["alloc_ms"], ("p50", "max"))),
        (f"allocation -> NVML shows it ms{kind}", _fmt(f["nvml_lag_ms"], ("p50", "max"))),
    ]


def _buckets(buckets: dict[str, float]) -> str:
    return ", ".join(f"{le}: {count:.0f}" for le, count in buckets.items())


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")


def parse_histogram(text: str, name: str) -> dict[str, Any] | None:
    """A Prometheus histogram (without labels of its own) from a text exposition:
    {"sum", "count", "buckets": {le: cumulative count}}; None when it is not there."""
    found: dict[str, Any] = {"buckets": {}}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        sample, value = match["name"], float(match["value"])
        if sample == f"{name}_sum":
            found["sum"] = value
        elif sample == f"{name}_count":
            found["count"] = value
        elif sample == f"{name}_bucket":
            le = re.search(r'le="([^"]*)"', match["labels"] or "")
            if le is not None:
                found["buckets"][le[1]] = value
    if "count" not in found:
        return None
    found.setdefault("sum", 0.0)
    return found


def handoff_ms_fields(
    flows_metadata: Iterable[dict[str, Any]], kinds: Sequence[str] = ("pressure",)
) -> dict[str, list[float]]:
    """Every numeric `*_ms` field of every handoff of these kinds in the flows' spillover
    metadata (pause_ms, and whatever detection times the addon records)."""
    fields: dict[str, list[float]] = {}
    for metadata in flows_metadata:
        spillover = metadata.get("spillover")
        if not isinstance(spillover, dict):
            continue
        for handoff in spillover.get("handoffs") or ():
            if not isinstance(handoff, dict) or handoff.get("kind") not in kinds:
                continue
            for key, value in handoff.items():
                if key.endswith("_ms") and isinstance(value, int | float):
                    fields.setdefault(key, []).append(float(value))
    return fields
