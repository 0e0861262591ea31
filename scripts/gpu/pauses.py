"""The pause a client sees at a handoff, at the lengths GPU users run (the GPU proof's
`--geometry` mode; rehearsed on the CPU by tests/test_gpu_pauses.py). One primary, three
proxies in front of it, one per way of handing off:

- re-read: a smaller model (on the same card) reads the whole conversation again, its
  cache erased first;
- shadow prefill: the same fallback, kept up to date with the answer every 8 tokens; the
  handoff comes once the shadow has caught up;
- KV migration: the same model in another process; the answer's KV state moves through
  a slot directory both servers save into.

The handoff is asked (POST /spillover/handoff) at the client's `cut`th chunk; the pause is
the client's gap from its last text before the handoff to its first text after (the
note comes once the continuation is ready, so after a migration has moved the state),
and the note to that text beside it. Cells are taken round by round (each once, then
again) until the time is spent, so every cell has a run before any has three.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

QUIET = [
    "spillover_stall_s=0", "spillover_slow_percent=0", "spillover_health_s=0",
]  # fmt: skip
SHADOW_EVERY = 8
NAMES = ("re-read", "shadow prefill", "KV migration")
MOVED = "tokens' KV state"


def options(name: str, slot_dir: Path) -> list[str]:
    """The proxy's options for one way of handing off."""
    if name == "shadow prefill":
        return [*QUIET, "spillover_shadow=always", f"spillover_shadow_every={SHADOW_EVERY}"]
    if name == "KV migration":
        return [*QUIET, "spillover_shadow=off", f"spillover_slot_dir={slot_dir}"]
    return [*QUIET, "spillover_shadow=off"]


@dataclass
class Setup:
    name: str  # one of NAMES
    proxy: Any  # a running mitmdump with the addon
    target: Any  # the fallback it hands off to: its slots are erased before each run


@dataclass
class Cell:
    length: int  # prompt + answer, in tokens
    setup: str
    runs: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def spread(self, key: str = "pause_ms") -> dict[str, float] | None:
        values = [r[key] for r in self.runs if r.get(key) is not None]
        if not values:
            return None
        return {
            "n": len(values),
            "min": round(min(values), 1),
            "median": round(statistics.median(values), 1),
            "max": round(max(values), 1),
        }

    def as_json(self) -> dict[str, Any]:
        return {
            "length": self.length, "setup": self.setup, "pause_ms": self.spread(),
            "note_to_text_ms": self.spread("note_to_text_ms"), "runs": self.runs,
            "errors": self.errors,
        }  # fmt: skip


def measure(
    setups: list[Setup],
    primary: Any,
    lengths: list[int],
    answer: int,
    cut: int,
    until: float,
    rounds: int = 3,
) -> list[Cell]:
    """Every (length, setup) cell, round by round until `rounds` or `until`."""
    from scripts.bench.shadow import prompt_of

    prompts = {length: prompt_of(length - answer, primary) for length in lengths}
    cells = [Cell(length, s.name) for length in lengths for s in setups]
    by_name = {s.name: s for s in setups}
    for _ in range(rounds):
        for cell in cells:
            if time.monotonic() >= until:
                return cells
            try:
                cell.runs.append(one_pause(by_name[cell.setup], prompts[cell.length], answer, cut))
            except (RuntimeError, httpx.HTTPError) as exc:
                cell.errors.append(f"{type(exc).__name__}: {exc}")
    return cells


def one_pause(setup: Setup, text: str, answer: int, cut: int) -> dict[str, Any]:
    """One answer handed off at the client's `cut`th chunk; read until the first text
    after the handoff (the rest is not timed)."""
    from scripts.bench.shadow import CONTROL, body, caught_up, erase

    erase(setup.target)
    chunks, note, note_at, last_before, first_after = 0, None, None, None, None
    url = setup.proxy.url
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body(text, answer), timeout=600
    ) as r:
        for line in r.iter_lines():
            now = time.perf_counter()
            if line.startswith(": spillover: handoff"):
                note, note_at = line, now
            elif line.startswith("data: {") and '"content"' in line:
                chunks += 1
                if note_at is None:
                    last_before = now
                else:
                    first_after = now
                    break
                if chunks == cut:
                    if setup.name == "shadow prefill":
                        caught_up(setup.proxy)
                    CONTROL.post(f"{url}/spillover/handoff").raise_for_status()
    if note is None or note_at is None or last_before is None or first_after is None:
        raise RuntimeError(f"no handoff in {chunks} chunks of {answer} (cut at {cut})")
    if setup.name == "KV migration" and MOVED not in note:
        raise RuntimeError(f"handed off without moving the KV state: {note}")
    return {
        "pause_ms": round((first_after - last_before) * 1000, 2),
        "note_to_text_ms": round((first_after - note_at) * 1000, 2),
        "note": note,
    }


def table(cells: list[Cell], what: str) -> str:
    """Pause ms as min / median / max (n), a row per length, a column per setup."""
    lengths = sorted({c.length for c in cells})
    names = [n for n in NAMES if any(c.setup == n for c in cells)]
    found = {(c.length, c.setup): c for c in cells}
    lines = [f"handoff pause, ms: min / median / max (runs); {what}"]
    lines.append(f"{'tokens':>8}" + "".join(f"  {n:>28}" for n in names))
    for length in lengths:
        row = []
        for name in names:
            cell = found[(length, name)]
            s = cell.spread()
            said = "not measured" if s is None else (
                f"{s['min']:,.0f} / {s['median']:,.0f} / {s['max']:,.0f} ({s['n']})"
            )  # fmt: skip
            row.append(said + (" !" if cell.errors else ""))
        lines.append(f"{length:>8,}" + "".join(f"  {r:>28}" for r in row))
    if any(c.errors for c in cells):
        lines.append(
            "! errors: "
            + "; ".join(f"{c.length} {c.setup}: {c.errors[0]}" for c in cells if c.errors)
        )
    return "\n".join(lines)
