"""What a soak saw (scripts/bench/soak.py): each answer's checks, the tally, the summary."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Seen:
    """What one request got back."""

    status: int = 0
    event_stream: bool = False
    json_body: bool = False  # the body of a non-stream answer parses as JSON
    chunks: int = 0
    done: int = 0
    finishes: int = 0
    ids: set[str | None] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    cancelled: bool = False
    max_tokens: int | None = None
    deltas: int = 0  # content deltas: one per token
    finish: str | None = None
    usage: dict[str, Any] | None = None
    errors: int = 0  # in-band error events

    def ended_with_an_error(self) -> bool:
        """A stream that ended with one readable in-band error event, nothing else wrong
        (what an answer that no server could continue ends with)."""
        return (
            self.status == 200 and self.event_stream and self.errors == 1 and not self.done
            and len(self.problems) == 1 and self.finishes == 0
        )  # fmt: skip

    def take(self, line: str) -> None:
        if line.startswith(": spillover:"):
            self.notes.append(line)
        elif line == "data: [DONE]":
            self.done += 1
        elif line.startswith("data: "):
            try:
                payload = json.loads(line[6:])
            except ValueError:
                self.problems.append(f"data line is not JSON: {line[:120]!r}")
                return
            if "error" in payload:
                self.problems.append(f"error event: {json.dumps(payload['error'])[:300]}")
                self.errors += 1
                return
            self.chunks += 1
            self.ids.add(payload.get("id"))
            for choice in payload.get("choices") or ():
                self.deltas += bool((choice.get("delta") or {}).get("content"))
                if choice.get("finish_reason"):
                    self.finishes += 1
                    self.finish = choice["finish_reason"]
            if payload.get("usage"):
                self.usage = payload["usage"]

    def faults(self) -> list[str]:
        if self.status != 200 or not self.event_stream:
            return [*self.problems, f"HTTP {self.status}, not an event stream"]
        if self.cancelled:
            return self.problems
        counts = {"[DONE]s": self.done, "finish_reasons": self.finishes, "ids": len(self.ids)}
        wrong = [f"{n} {k}" for k, n in counts.items() if n != 1]
        counted = (self.usage or {}).get("completion_tokens")
        if self.usage is not None and counted != self.deltas:
            wrong.append(f"usage counts {counted} tokens, the stream carried {self.deltas}")
        if self.finish == "length" and self.max_tokens not in (None, self.deltas):
            wrong.append(f"ended for length after {self.deltas} of {self.max_tokens} tokens")
        return self.problems + wrong


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    broken: list[str] = field(default_factory=list)
    notes: Counter[str] = field(default_factory=Counter)  # handoff notes by kind
    asks: int = 0
    moved: int = 0  # streams the POSTs handed off
    steps: int = 0
    malformed: Counter[str] = field(default_factory=Counter)  # "kind: answer"
    malformed_bad: list[str] = field(default_factory=list)
    victims: Counter[str] = field(default_factory=Counter)  # outcome
    victims_changed: list[str] = field(default_factory=list)
    kills: int = 0
    stops: int = 0
    cancelled_after_handoff: int = 0
    migrated: int = 0  # handoffs whose note says the KV state moved

    def add(self, seen: Seen) -> None:
        self.notes.update(note_kind(note) for note in seen.notes)
        self.migrated += sum("tokens' KV state" in note for note in seen.notes)
        faults = seen.faults()
        outcome = "broken" if faults else "cancelled" if seen.cancelled else "clean"
        self.outcomes[outcome] += 1
        if faults:
            self.broken.append("; ".join(faults))


def note_kind(note: str) -> str:
    """pressure, requested or failure, from a note "...after N tokens (reason)..."."""
    reason = note.partition(" (")[2]
    if reason.startswith("memory pressure"):
        return "pressure"
    return "requested" if reason.startswith("requested") else "failure"


@dataclass
class Left:
    """What the proxy holds and says once the soak is over."""

    status: dict[str, Any]  # its /spillover/status
    metrics: str  # its /spillover/metrics
    log: str
    slot_files: list[str]
    guard_said: list[str]


def report(
    tally: Tally,
    rss_fds: dict[str, tuple[float, int]],
    left: Left,
    busy: dict[str, tuple[int, int] | str],
) -> list[str]:
    """Print the summary; returns what failed."""
    sent = sum(tally.malformed.values())
    notes = ", ".join(f"{kind} {n}" for kind, n in sorted(tally.notes.items()))
    status, log, left_files = left.status, left.log, left.slot_files
    counted = re.findall(r'spillover_handoffs_total\{kind="(\w+)"\} ([\d.]+)', left.metrics)
    reserved = {url: s for url, s in status["migration"]["reserved"].items() if s}
    tracebacks = log.count("Traceback (most recent call last)")
    guard_left = [line for line in left.guard_said if "not answering" in line]
    victims = ", ".join(f"{kind} {n}" for kind, n in sorted(tally.victims.items()))
    rows = [
        ("streams started", f"{tally.outcomes.total()}"),
        ("  clean", f"{tally.outcomes['clean']}"),
        ("  broken", f"{tally.outcomes['broken']}"),
        ("  cancelled by the soak", f"{tally.outcomes['cancelled']}"),
        ("  of those, after a handoff", f"{tally.cancelled_after_handoff}"),
        ("handoffs seen (notes)", f"{sum(tally.notes.values())} ({notes or 'none'})"),
        ("handoff POSTs", f"{tally.asks} (streams moved: {tally.moved})"),
        ("pressure steps on card0", f"{tally.steps}"),
        ("small fallback killed / primary stopped", f"{tally.kills} / {tally.stops}"),
        ("handoffs that moved the KV state", f"{tally.migrated}"),
        ("victims' answers", victims or "none"),
        ("malformed, well-formed answer", f"{sent - len(tally.malformed_bad)} of {sent}"),
    ]
    for moment, (rss, fds) in rss_fds.items():
        rows.append((f"mitmdump RSS MiB / fds, {moment}", f"{rss:.1f} / {fds}"))
    rows += [
        ("addon: handoffs counted", ", ".join(f"{k} {float(n):.0f}" for k, n in counted)),
        ("addon: live streams left", f"{len(status['live'])}"),
        ("addon: shadows left", f"{status['shadows']['shadowing'] or 'none'}"),
        ("slot files / reserved slots left", f"{len(left_files)} / {reserved or 'none'}"),
        ("tracebacks in mitmdump's log", f"{tracebacks}"),
        ("guard left the proxy", f"{len(guard_left)} times"),
    ]
    rows += [
        (f"busy slots, {name}", slots if isinstance(slots, str) else "{} of {}".format(*slots))
        for name, slots in busy.items()
    ]
    print()
    for label, value in rows:
        print(f"{label:40} {value}")
    for answer, n in sorted(tally.malformed.items()):
        print(f"  malformed {answer} x{n}")
    for text in tally.broken[:10]:
        print(f"BROKEN: {text}")
    for text in tally.victims_changed[:10]:
        print(f"VICTIM CHANGED: {text}")
    for text in tally.malformed_bad[:10]:
        print(f"MALFORMED, NO WELL-FORMED ANSWER: {text}")
    failed = {
        "broken streams": bool(tally.broken),
        "changed victims": bool(tally.victims_changed),
        "malformed without an answer": bool(tally.malformed_bad),
        "tracebacks": bool(tracebacks),
        "the guard left the proxy": bool(guard_left),
        "slot files or reserved slots left": bool(left_files or reserved),
    }
    return [what for what, bad in failed.items() if bad]
