"""Soak test: many answers through the guard and a real mitmdump with the addon while
handoffs, shadows, migrations, kills and stalls happen, and nothing the addon does on
its own may change another answer.

Three llama-servers on the tiny models: the primary (fake card0 of a sysfs tree of real
files), a twin running the same model (card1: answers migrate there with their KV
state, the two share a slot directory) and a smaller fallback (card2), behind mitmdump
with the addon as `scripts.services` sets it up for a public address (control routes
need the token; shadows on, always), behind the fail-open guard, which checks the proxy
with the token. For M minutes (after a 6 s warm-up of the same): 8 client streams at a
time, each asking for usage; a handoff of every live stream asked for every 2 s; card0
stepped past the memory lines and back every 2-5 s; some streams closed after a random
number of chunks, and some 0-120 ms after their first handoff (a migration may be under
way); the small fallback SIGKILLed and started again every 40 s, the primary stopped
(SIGSTOP) for 3 s every 30 s; a malformed request every 3 s, which must get a JSON
answer (or, if the server takes it, a clean stream); and on the twin and the small
fallback, clients of their own (scripts/testbed/victims.py), each answer checked for its exact
token count and, token by token, against the same request made alone.

A stream is clean (200, every data line JSON, one [DONE], one finish_reason, no error
event, one id, usage that counts the content it carried, all max_tokens when it ended
for length), cancelled (closed by the soak) or broken. Prints a summary: outcomes,
handoffs, migrations, shadow updates, victims, mitmdump's RSS and descriptors after the
warm-up, at the end and once idle, the addon's own counts, live streams, tracebacks,
slot files and busy slots left. Exits 1 if a stream broke, a victim's answer changed, a
malformed request got no well-formed answer, mitmdump logged a traceback, the guard
left the proxy, or a slot file or reserved slot was left behind. `--trace-memory`
loads scripts/bench/memtrace.py into mitmdump and prints where its memory grew.

    .venv/bin/python -m scripts.bench.soak [--minutes M] [--seed S] [--warm-up-s S] [--trace-memory]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from scripts.bench.soaktally import Left, Seen, Tally, report
from scripts.guard import GuardProcess
from scripts.parts.processes import running
from scripts.testbed import victims
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.memfiles import FakeCard
from scripts.testbed.mitm import REPO, Mitmdump, watch_sysfs
from scripts.testbed.prompts import PROMPT, chat_body
from scripts.testbed.tinymodels import ensure_models

CONCURRENCY = 8
WARM_UP_S = 6.0  # a short soak first, so the start sample has seen every path once
STREAM_TIMEOUT = 60.0  # seconds one request may take, start to end
CANCEL_SHARE = 0.15  # of streams the soak closes early
CANCEL_AFTER_HANDOFF = (0.3, 0.12)  # share of handed-off streams closed, within seconds
HANDOFF_EVERY = 2.0
PRESSURE_EVERY = (2.0, 5.0)  # seconds between steps, drawn uniformly
PRESSURE_HOLD = 0.5  # the watcher needs two samples in a row past a line
CARD_TOTAL, CARD_USED, CARD_STEP = 16384, 10000, 15041  # MiB: +5,041 leaves 1,343 free
MALFORMED_EVERY = 3.0
KILL_EVERY, STOP_EVERY, STOP_FOR = 40.0, 30.0, 3.0
VICTIM_TOKENS, VICTIM_PROMPTS = 300, 3
SLOT_FILES = "spillover-*.bin"
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


async def fetch(
    client: httpx.AsyncClient,
    url: str,
    content: bytes,
    cancel_after: int | None = None,
    cancel_after_handoff: float | None = None,
) -> Seen:
    """POST a chat completion and read the answer; close it after `cancel_after` chunks,
    or `cancel_after_handoff` seconds after its first handoff note."""
    seen = Seen()
    closing_at = None
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
                    if seen.notes and cancel_after_handoff is not None and closing_at is None:
                        closing_at = time.monotonic() + cancel_after_handoff
                    if seen.chunks == cancel_after or (
                        closing_at is not None and time.monotonic() >= closing_at
                    ):
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
        body = chat_body(max_tokens, stream_options={"include_usage": True})
        cancel = rng.randint(1, max_tokens - 1) if rng.random() < CANCEL_SHARE else None
        share, within = CANCEL_AFTER_HANDOFF
        after_handoff = rng.uniform(0, within) if rng.random() < share else None
        seen = await fetch(client, url, json.dumps(body).encode(), cancel, after_handoff)
        seen.max_tokens = max_tokens
        if seen.cancelled and seen.notes and cancel is None:
            tally.cancelled_after_handoff += 1
        tally.add(seen)


async def handoffs(client: httpx.AsyncClient, url: str, token: str, tally: Tally) -> None:
    while True:
        await asyncio.sleep(HANDOFF_EVERY)
        reply = await client.post(f"{url}/spillover/handoff", headers=bearer(token))
        tally.asks += 1
        tally.moved += reply.json().get("handed_off", 0)  # (the primary's 404 via the guard)


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


async def chaos(small: LlamaServer, primary: LlamaServer, tally: Tally) -> None:
    """The small fallback SIGKILLed and started again on its port every KILL_EVERY
    seconds; the primary stopped for STOP_FOR seconds every STOP_EVERY."""
    started = time.monotonic()
    kills = stops = 0
    while True:
        await asyncio.sleep(0.5)
        elapsed = time.monotonic() - started
        if elapsed >= (kills + 1) * KILL_EVERY:
            kills += 1
            small.kill()
            small.launch()  # here: a process dies with the thread that started it
            await asyncio.to_thread(small.wait_healthy)
            tally.kills += 1
        if elapsed >= (stops + 1) * STOP_EVERY:
            stops += 1
            os.kill(primary.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(STOP_FOR)
            finally:
                os.kill(primary.pid, signal.SIGCONT)
            tally.stops += 1


async def victims_of(
    client: httpx.AsyncClient, server: LlamaServer, alone: list[dict], tally: Tally, until: float
) -> None:
    """The server's own clients, one at a time per task (see scripts/testbed/victims.py)."""
    index = 0
    while time.monotonic() < until:
        index = (index + 1) % len(alone)
        try:
            answer = await victims.ask(client, server.url, index, VICTIM_TOKENS)
        except (httpx.HTTPError, ValueError):
            tally.victims["interrupted (its server was killed)"] += 1
            await asyncio.sleep(0.5)
            continue
        if (how := victims.changed(answer, alone[index], VICTIM_TOKENS)) is not None:
            tally.victims["CHANGED"] += 1
            tally.victims_changed.append(f"{server.url}: {how}")
        else:
            tally.victims["as alone"] += 1


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
        # A constrained answer cut by a stall ends with an in-band error: readable too.
        errored = seen.ended_with_an_error()
        well_formed = seen.json_body or errored or (seen.event_stream and not seen.faults())
        kind_of = "JSON" if seen.json_body else "in-band error" if errored else "stream"
        answer = f"{seen.status} {kind_of}"
        tally.malformed[f"{kind}: {answer if well_formed else 'BAD'}"] += 1
        if not well_formed:
            tally.malformed_bad.append(f"{kind}: HTTP {seen.status}; {seen.faults()}")


@dataclass
class Bed:
    """The servers, the proxy and the guard, and what the soak needs to know of them."""

    primary: LlamaServer
    twin: LlamaServer
    small: LlamaServer
    proxy: Mitmdump
    guard: GuardProcess
    card0: FakeCard
    token: str
    slot_dir: Path
    alone: dict[str, list[dict]] = field(default_factory=dict)  # victims' solo answers


async def soak(bed: Bed, seconds: float, rng: random.Random, tally: Tally) -> None:
    url = bed.guard.url
    async with httpx.AsyncClient(timeout=STREAM_TIMEOUT) as client:
        side = [
            asyncio.create_task(handoffs(client, url, bed.token, tally)),
            asyncio.create_task(pressure(bed.card0, rng, tally)),
            asyncio.create_task(malformed(client, url, tally)),
            asyncio.create_task(chaos(bed.small, bed.primary, tally)),
        ]
        until = time.monotonic() + seconds
        await asyncio.gather(
            *(streams(client, url, rng, tally, until) for _ in range(CONCURRENCY)),
            *(
                victims_of(client, server, bed.alone[server.url], tally, until)
                for server in (bed.twin, bed.small)
            ),
        )
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


def busy_slots(server: LlamaServer, settle: float = 5.0) -> tuple[int, int] | str:
    """(slots still processing, slots) once the server has had `settle` s to go idle."""
    deadline = time.monotonic() + settle
    while True:
        try:
            slots = httpx.get(f"{server.url}/slots", timeout=5).json()
        except httpx.HTTPError as exc:
            if time.monotonic() > deadline:
                return f"unreachable ({type(exc).__name__})"
            time.sleep(0.1)
            continue
        busy = sum(1 for slot in slots if slot["is_processing"])
        if busy == 0 or time.monotonic() > deadline:
            return busy, len(slots)
        time.sleep(0.1)


def wait_known(bed: Bed, timeout: float = 10) -> None:
    urls = [bed.primary.url, bed.twin.url, bed.small.url]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = httpx.get(f"{bed.proxy.url}/spillover/status", headers=bearer(bed.token))
        servers = reply.json()["servers"]
        if all(url in servers and servers[url].get("fingerprint") for url in urls):
            return
        time.sleep(0.05)
    raise RuntimeError(f"the addon never heard back from {urls}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace-memory", action="store_true")
    parser.add_argument(
        "--warm-up-s", type=float, default=WARM_UP_S,
        help="the soak before the first memory sample (Python's heap grows for a while)",
    )  # fmt: skip
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="spillover-soak-"))
    models = ensure_models(work / "models")
    sysfs, slot_dir = work / "sys", work / "slots"
    slot_dir.mkdir()
    card0 = FakeCard(sysfs, "card0", total_mib=CARD_TOTAL, used_mib=CARD_USED)
    FakeCard(sysfs, "card1", total_mib=16384, used_mib=2000)
    FakeCard(sysfs, "card2", total_mib=8192, used_mib=2000)
    saves = ["--slot-save-path", str(slot_dir)]
    primary = LlamaServer(models["primary"], ctx_size=8192, extra_args=saves, log_dir=work)
    twin = LlamaServer(models["primary"], ctx_size=8192, extra_args=saves, log_dir=work)
    small = LlamaServer(models["fallback"], ctx_size=8192, log_dir=work)
    token = secrets.token_urlsafe(32)
    token_path = work / "control-token"
    token_path.write_text(token + "\n")
    on = {primary.url: "drm:card0", twin.url: "drm:card1", small.url: "drm:card2"}
    options = [
        *watch_sysfs(sysfs, on), "spillover_shadow=always", "spillover_shadow_every=8",
        "spillover_shadow_max=4", f"spillover_slot_dir={slot_dir}", "spillover_dwell_s=2",
        "spillover_stall_s=2", "spillover_control_local=false",
        f"spillover_control_token=@{token_path}",
    ]  # fmt: skip
    memtrace = work / "memtrace.txt"
    scripts = [REPO / "scripts" / "memtrace.py"] if args.trace_memory else []
    if args.trace_memory:
        options.append(f"memtrace_file={memtrace}")
    proxy = Mitmdump(
        primary.url, [twin.url, small.url], options=options, log_dir=work, scripts=scripts
    )
    proxy.health_path = "/health"  # its control routes are the token's only
    target = primary.url.split("//")[1]
    # The guard's own defaults (the test bed's are quicker): two cores run everything here.
    defaults = ["--every-s", "0.5", "--timeout-s", "1"]
    guard = GuardProcess(
        proxy.port, target, work, extra_args=[*defaults, "--token-file", str(token_path)]
    )
    guard.health_path = "/health"
    bed = Bed(primary, twin, small, proxy, guard, card0, token, slot_dir)
    tally = Tally()
    with running(primary, twin, small, proxy, guard):
        wait_known(bed)
        bed.alone = {
            server.url: [
                httpx.post(
                    f"{server.url}/completion",
                    json=victims.victim_body(i, VICTIM_TOKENS), timeout=60,
                ).json()
                for i in range(VICTIM_PROMPTS)
            ]
            for server in (twin, small)
        }  # fmt: skip
        print(f"soak: {args.minutes:g} min, seed {args.seed}, guard {guard.url}, logs {work}")
        idle = usage(proxy.pid)
        rng = random.Random(args.seed)
        asyncio.run(soak(bed, args.warm_up_s, rng, tally))
        warm = usage(proxy.pid)
        if args.trace_memory:
            os.kill(proxy.pid, signal.SIGUSR1)  # the baseline snapshot
        asyncio.run(soak(bed, args.minutes * 60, rng, tally))
        end = usage(proxy.pid)
        busy = {
            s: busy_slots(server)
            for s, server in (("primary", primary), ("twin", twin), ("small", small))
        }
        time.sleep(5)
        rested = usage(proxy.pid)
        (work / "mitmdump-sockets.txt").write_text(
            subprocess.run(["ss", "-tanpH"], capture_output=True, text=True).stdout
            if shutil.which("ss")
            else ""
        )
        if args.trace_memory:
            os.kill(proxy.pid, signal.SIGUSR1)
            time.sleep(3)
        moments = {"idle, before": idle, "after warm-up": warm, "at the end": end}
        moments["idle, 5 s after"] = rested
        left = Left(
            status=httpx.get(f"{proxy.url}/spillover/status", headers=bearer(token)).json(),
            metrics=httpx.get(f"{proxy.url}/spillover/metrics", headers=bearer(token)).text,
            log=proxy.log_path.read_text(errors="replace"),
            slot_files=sorted(p.name for p in slot_dir.glob(SLOT_FILES)),
            guard_said=guard.said(),
        )
        failed = report(tally, moments, left, busy)
        if args.trace_memory and memtrace.exists():
            print("\nwhere mitmdump's memory grew (scripts/bench/memtrace.py):")
            print(memtrace.read_text())
    if failed:
        print(f"\nFAILED: {', '.join(failed)}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
