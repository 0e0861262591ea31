"""Where a proxy's time goes under paced streams: py-spy samples the proxy's process while
N answers stream at a decode step's pace (the paced bench's stand-in and client), and
every sample is put in one bucket by the innermost frame it can name: mitmproxy's own
work, the SSE split, JSON parsing, the fields taken out of each chunk, the rewrite, the
bookkeeping, the endpoint's writes, the writes to the client's connection, the event
loop and its sockets. Printed per route, in percent of the samples and in CPU ms per
1,000 events.

    .venv/bin/python -m scripts.bench.profile [--streams 64,256] [--routes addon,ids,plain]
        [--handoff] [--seconds 6]

`--handoff` asks each answer to move once (POST /spillover/handoff) midway, so the
profile holds the handoff's work too. Needs py-spy (`pip install py-spy`) and the right
to read another process's memory (root, or ptrace_scope 0).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from scripts.bench.paced import paced_streams
from scripts.bench.splice import SseSource, cpu_seconds, wait_for_tokenizers
from scripts.parts.processes import running
from scripts.testbed.mitm import Mitmdump

# Each sample goes to the innermost frame that is someone's own work: a library frame
# (the HTTP/1 parser, asyncio's transports, the selector) counts for whoever called it;
# a sample with no such frame is the event loop itself (waiting, dispatching callbacks).
BUCKETS = (
    ("json parse", ("json/decoder.py", "loads (json/__init__.py", "orjson", "msgspec")),
    ("json dump", ("json/encoder.py", "dumps (json/__init__.py")),
    ("sse split", ("formats/sse.py", "formats/blocks.py")),
    ("fields", ("formats/wire.py", "formats/chat.py", "formats/shape.py", "formats/sizes.py")),
    ("rewrite", ("formats/continuation.py", "formats/startover.py", "formats/dialect.py")),
    ("transcript", ("formats/transcript.py", "formats/pieces.py")),
    ("endpoint", ("answer/endpoint.py", "answer/inprocess.py")),
    ("client's connection", ("answer/clientwire.py",)),
    ("pump, splice", ("answer/pump.py", "answer/splice.py", "answer/legs.py", "answer/pace.py")),
    ("addon, other", ("addon/",)),
    ("httpx (addon's legs)", ("httpx/", "httpcore/")),
    ("mitmproxy", ("mitmproxy/",)),
)
LOOP = "event loop, hops"
ROOTS = ("mitmproxy/tools/", "mitmproxy/master.py", "mitmproxy/addons/errorcheck.py")


def bucket_of(stack: str) -> str:
    for frame in reversed(stack.split(";")):
        if any(root in frame for root in ROOTS):
            return LOOP
        for name, places in BUCKETS:
            if any(place in frame for place in places):
                return name
    return LOOP


def profile(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy")),
            "record", "-p", str(pid), "-r", "250", "-d", str(int(seconds)),
            "-f", "raw", "-o", str(out), "--nonblocking",
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def tally(raw: Path) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if "threading.py" in stack:
            continue  # another thread (the memory monitor's): not the event loop's work
        counts[bucket_of(stack)] += int(count)
    return counts


def hand_off_midway(proxy_url: str, seconds: float, stop: threading.Event) -> None:
    """Ask every live answer to move, once, halfway through (an answer that ended
    meanwhile, or a proxy too busy to answer in time, is left as it is)."""
    if stop.wait(seconds / 2):
        return
    with httpx.Client(timeout=30) as control:
        try:
            live = control.get(f"{proxy_url}/spillover/status").json().get("live") or []
            for answer in live:
                control.post(
                    f"{proxy_url}/spillover/handoff",
                    json={"flow": answer["flow"], "reason": "profile"},
                )
        except httpx.HTTPError as exc:
            print(f"handoffs asked in part: {exc!r}", file=sys.stderr)


def run_route(name: str, source: SseSource, twin: SseSource, work: Path, args) -> list[str]:
    fallbacks = [twin.url] if name in ("ids", "handoff") else []
    proxy = Mitmdump(source.url, fallbacks, addon=name != "plain", log_dir=work)
    lines = []
    with running(proxy):
        if fallbacks:
            wait_for_tokenizers(proxy)
        for streams in args.streams:
            asyncio.run(paced_streams(proxy.port, min(streams, 8), args.rate, 0.5))
            raw = work / f"{name}-{streams}.txt"
            spy = profile(proxy.pid, args.seconds, raw)
            time.sleep(0.5)
            stop = threading.Event()
            mover = threading.Thread(
                target=hand_off_midway, args=(proxy.url, args.seconds - 1, stop), daemon=True
            )
            if name == "handoff":
                mover.start()
            used = cpu_seconds([proxy.pid])
            events, _, _, _ = asyncio.run(
                paced_streams(proxy.port, streams, args.rate, args.seconds - 1)
            )
            cpu = cpu_seconds([proxy.pid]) - used
            stop.set()
            spy.wait()
            counts = tally(raw)
            total = sum(counts.values()) or 1
            lines.append(
                f"{name}, {streams} streams: {events:,} events, proxy CPU "
                f"{1e6 * cpu / events:,.0f} us per event; {total:,} samples"
            )
            for bucket, count in counts.most_common():
                share = count / total
                per_event = 1e6 * cpu / events * share
                lines.append(f"    {bucket:22} {100 * share:5.1f} %  {per_event:6.1f} us/event")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="64,256")
    parser.add_argument("--routes", default="plain,addon,ids,handoff")
    parser.add_argument("--rate", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=6)
    args = parser.parse_args()
    args.streams = [int(n) for n in args.streams.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path("/tmp/prof") if __import__("os").environ.get("KEEP") else Path(tmp)
        work.mkdir(exist_ok=True)
        source, twin = SseSource(log_dir=work), SseSource(log_dir=work)
        with running(source, twin):
            for name in args.routes.split(","):
                print("\n".join(run_route(name, source, twin, work, args)), flush=True)


if __name__ == "__main__":
    main()
