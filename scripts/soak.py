"""Soak test: many streams through a real mitmdump with the addon while handoffs happen.

Two llama-servers on the tiny models (the primary on fake card0, the fallback on card1 of
a sysfs tree of real files) behind mitmdump with the addon, all on 127.0.0.1. For M
minutes (after a 6 s warm-up of the same), 8 client streams at a time, plus: a handoff
of every live stream asked for (POST /spillover/handoff) every 2 s, card0 stepped past
the memory lines and back every 2-5 s, some streams closed after a random number of
chunks, and a malformed request every 3 s, which must get a JSON answer (or, if the
server takes it, a clean stream). A stream is clean (200, every data line JSON, one
[DONE], one finish_reason, no error event, one id), cancelled (closed by the soak) or
broken. Prints a summary: outcomes, handoffs, mitmdump's RSS and descriptors after the
warm-up and at the end, the addon's own counts, live streams and logged tracebacks, the
servers' busy slots. Exits 1 if a stream broke, a malformed request got no
well-formed answer, or mitmdump logged a traceback.

    .venv/bin/python -m scripts.soak [--minutes M] [--seed S]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from scripts.llamaserver import LlamaServer
from scripts.memfiles import FakeCard
from scripts.mitm import Mitmdump, watch_sysfs
from scripts.processes import running
from scripts.prompts import PROMPT, chat_body
from scripts.tinymodels import ensure_models

CONCURRENCY = 8
WARM_UP_S = 6.0  # a short soak first, so the start sample has seen every path once
STREAM_TIMEOUT = 60.0  # seconds one request may take, start to end
CANCEL_SHARE = 0.15  # of streams the soak closes early
HANDOFF_EVERY = 2.0
PRESSURE_EVERY = (2.0, 5.0)  # seconds between steps, drawn uniformly
PRESSURE_HOLD = 0.5  # the watcher needs two samples in a row past a line
CARD_TOTAL, CARD_USED, CARD_STEP = 16384, 10000, 15041  # MiB: +5,041 leaves 1,343 free
MALFORMED_EVERY = 3.0
JSON_HEADERS = {"content-type": "application/json"}
PREFILL_PARTS = {"role": "assistant", "content": [{"type": "text", "text": "Once upon"}]}


def _changed(**changes: Any) -> bytes:
    return json.dumps({**chat_body(50), **changes}).encode()


MALFORMED: list[tuple[str, bytes]] = [
    ("bad JSON", b'{"messages": [{"role": "user", "content": "hi"}'),
    ("messages is a string", _changed(messages="x")),
    ("max_tokens is a string", _changed(max_tokens="ten")),
    ("stream_options is a string", _changed(stream_options="yes")),
    ("response_format is a string", _changed(response_format="json_object")),
    ("assistant prefill as content parts", _changed(messages=[*PROMPT, PREFILL_PARTS])),
]


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
                return
            self.chunks += 1
            self.ids.add(payload.get("id"))
            self.finishes += sum(1 for c in payload.get("choices") or () if c.get("finish_reason"))

    def faults(self) -> list[str]:
        if self.status != 200 or not self.event_stream:
            return [*self.problems, f"HTTP {self.status}, not an event stream"]
        counts = {"[DONE]s": self.done, "finish_reasons": self.finishes, "ids": len(self.ids)}
        wrong = [] if self.cancelled else [f"{n} {k}" for k, n in counts.items() if n != 1]
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

    def add(self, seen: Seen) -> None:
        self.notes.update(note_kind(note) for note in seen.notes)
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


async def fetch(
    client: httpx.AsyncClient, url: str, content: bytes, cancel_after: int | None = None
) -> Seen:
    """POST a chat completion and read the answer; close it after `cancel_after` chunks."""
    seen = Seen()
    try:
        async with asyncio.timeout(STREAM_TIMEOUT):
            async with client.stream(
                "POST", f"{url}/v1/chat/completions", content=content, headers=JSON_HEADERS
            ) as response:
                seen.status = response.status_code
                seen.event_stream = "text/event-stream" in response.headers.get("content-type", "")
                if not seen.event_stream:
                    with contextlib.suppress(ValueError):
                        json.loads(await response.aread())
                        seen.json_body = True
                    return seen
                async for line in response.aiter_lines():
                    seen.take(line)
                    if seen.chunks == cancel_after:
                        seen.cancelled = True
                        break
    except (httpx.HTTPError, TimeoutError) as exc:
        seen.problems.append(f"{type(exc).__name__}: {exc}")
    return seen


async def streams(
    client: httpx.AsyncClient, url: str, rng: random.Random, tally: Tally, until: float
) -> None:
    while time.monotonic() < until:
        max_tokens = rng.randint(32, 512)
        extra = {"stream_options": {"include_usage": True}} if rng.random() < 0.3 else {}
        body = chat_body(max_tokens, **extra)
        cancel = rng.randint(1, max_tokens - 1) if rng.random() < CANCEL_SHARE else None
        tally.add(await fetch(client, url, json.dumps(body).encode(), cancel))


async def handoffs(client: httpx.AsyncClient, url: str, tally: Tally) -> None:
    while True:
        await asyncio.sleep(HANDOFF_EVERY)
        reply = await client.post(f"{url}/spillover/handoff")
        tally.asks += 1
        tally.moved += reply.json()["handed_off"]


async def pressure(card: FakeCard, rng: random.Random, tally: Tally) -> None:
    try:
        while True:
            await asyncio.sleep(rng.uniform(*PRESSURE_EVERY))
            card.set_used(CARD_STEP)
            tally.steps += 1
            await asyncio.sleep(PRESSURE_HOLD)
            card.set_used(CARD_USED)
    finally:
        card.set_used(CARD_USED)


async def malformed(client: httpx.AsyncClient, url: str, tally: Tally) -> None:
    for kind, content in itertools.cycle(MALFORMED):
        await asyncio.sleep(MALFORMED_EVERY)
        seen = await fetch(client, url, content)
        well_formed = seen.json_body or (seen.event_stream and not seen.faults())
        answer = f"{seen.status} {'JSON' if seen.json_body else 'stream'}"
        tally.malformed[f"{kind}: {answer if well_formed else 'BAD'}"] += 1
        if not well_formed:
            tally.malformed_bad.append(f"{kind}: HTTP {seen.status}; {seen.faults()}")


async def soak(url: str, card: FakeCard, seconds: float, rng: random.Random, tally: Tally) -> None:
    async with httpx.AsyncClient(timeout=STREAM_TIMEOUT) as client:
        side = [
            asyncio.create_task(handoffs(client, url, tally)),
            asyncio.create_task(pressure(card, rng, tally)),
            asyncio.create_task(malformed(client, url, tally)),
        ]
        until = time.monotonic() + seconds
        await asyncio.gather(*(streams(client, url, rng, tally, until) for _ in range(CONCURRENCY)))
        for task in side:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def usage(pid: int) -> tuple[float, int]:
    """(RSS in MiB, open descriptors) of a process, after a second to settle."""
    time.sleep(1)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024, len(os.listdir(f"/proc/{pid}/fd"))
    raise RuntimeError(f"no VmRSS for {pid}")


def busy_slots(server: LlamaServer, settle: float = 5.0) -> tuple[int, int]:
    """(slots still processing, slots) once the server has had `settle` s to go idle."""
    deadline = time.monotonic() + settle
    while True:
        slots = httpx.get(f"{server.url}/slots", timeout=5).json()
        busy = sum(1 for slot in slots if slot["is_processing"])
        if busy == 0 or time.monotonic() > deadline:
            return busy, len(slots)
        time.sleep(0.1)


def report(
    tally: Tally,
    start: tuple[float, int],
    end: tuple[float, int],
    proxy: Mitmdump,
    busy: dict[str, tuple[int, int]],
) -> None:
    sent = sum(tally.malformed.values())
    notes = ", ".join(f"{kind} {n}" for kind, n in sorted(tally.notes.items()))
    log = proxy.log_path.read_text(errors="replace")
    live = httpx.get(f"{proxy.url}/spillover/status").json()["live"]
    metrics = httpx.get(f"{proxy.url}/spillover/metrics").text
    counted = re.findall(r'spillover_handoffs_total\{kind="(\w+)"\} ([\d.]+)', metrics)
    rows = [
        ("streams started", f"{tally.outcomes.total()}"),
        ("  clean", f"{tally.outcomes['clean']}"),
        ("  broken", f"{tally.outcomes['broken']}"),
        ("  cancelled by the soak", f"{tally.outcomes['cancelled']}"),
        ("handoffs seen (notes)", f"{sum(tally.notes.values())} ({notes or 'none'})"),
        ("handoff POSTs", f"{tally.asks} (streams moved: {tally.moved})"),
        ("pressure steps on card0", f"{tally.steps}"),
        ("malformed, well-formed answer", f"{sent - len(tally.malformed_bad)} of {sent}"),
        ("mitmdump RSS MiB start/end", f"{start[0]:.1f} / {end[0]:.1f}"),
        ("mitmdump fds start/end", f"{start[1]} / {end[1]}"),
        ("addon: handoffs counted", ", ".join(f"{k} {float(n):.0f}" for k, n in counted)),
        ("addon: live streams left", f"{len(live)}"),
        ("tracebacks in mitmdump's log", f"{log.count('Traceback (most recent call last)')}"),
    ]
    rows += [(f"busy slots, {name}", "{} of {}".format(*slots)) for name, slots in busy.items()]
    print()
    for label, value in rows:
        print(f"{label:32} {value}")
    for answer, n in sorted(tally.malformed.items()):
        print(f"  malformed {answer} x{n}")
    for text in tally.broken[:10]:
        print(f"BROKEN: {text}")
    for text in tally.malformed_bad[:10]:
        print(f"MALFORMED, NO WELL-FORMED ANSWER: {text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="spillover-soak-"))
    models = ensure_models(work / "models")
    sysfs = work / "sys"
    card0 = FakeCard(sysfs, "card0", total_mib=CARD_TOTAL, used_mib=CARD_USED)
    FakeCard(sysfs, "card1", total_mib=8192, used_mib=2000)
    primary = LlamaServer(models["primary"], log_dir=work)
    fallback = LlamaServer(models["fallback"], log_dir=work)
    on = {primary.url: "drm:card0", fallback.url: "drm:card1"}
    proxy = Mitmdump(primary.url, [fallback.url], options=watch_sysfs(sysfs, on), log_dir=work)
    tally = Tally()
    with running(primary, fallback, proxy):
        proxy.servers_known()
        print(f"soak: {args.minutes:g} min, seed {args.seed}, proxy {proxy.url}, logs {work}")
        rng = random.Random(args.seed)
        asyncio.run(soak(proxy.url, card0, WARM_UP_S, rng, tally))
        start = usage(proxy.pid)
        asyncio.run(soak(proxy.url, card0, args.minutes * 60, rng, tally))
        busy = {"primary": busy_slots(primary), "fallback": busy_slots(fallback)}
        report(tally, start, usage(proxy.pid), proxy, busy)
    tracebacks = proxy.log_path.read_text(errors="replace").count("Traceback (most recent")
    sys.exit(1 if tally.broken or tally.malformed_bad or tracebacks else 0)


if __name__ == "__main__":
    main()
