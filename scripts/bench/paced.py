"""Benchmark: many answers streaming at once, each at a decode step's pace, as a busy GPU
server writes them (vLLM's default batch is 256 sequences, each a chunk per step).

A stand-in server (scripts/testbed/sse_source.py) streams N answers at RATE events/s
each, started together; the client reads them all over raw sockets and times each event
from the server's send stamp to its arrival. Side by side in one run: direct, plain
mitmdump, the addon, the addon asking for token ids (a fallback with the same
tokenizer: a second stand-in), plain mitmdump carrying the same chunks as that row (its
client asks for the ids: what a longer chunk costs any proxy), and the addon over worker
processes behind HAProxy (`--workers 2,4,8`: a row per count, where HAProxy is
installed); `--api messages` streams Anthropic Messages events instead of chat chunks, and
`--api responses` OpenAI Responses events (no token-ids rows: the addon asks for ids on
chat only). For each: events/s
delivered against asked, p50 and p99 latency (ms), what the route adds to direct's, and
the proxy's CPU (its processes together, in cores, and in CPU seconds per 10,000 events
delivered) and its memory per 1,000 open streams (its resident memory at its most while
the row streams, over idle), and when the last stream's first event came ("1st max", ms
after all were asked); then each route against plain mitmdump, as ratios. The p99 counts
the start too: every stream starts at once, and their first events wait on the others'
starts, so "p99 4th+" is the p99 of each stream's events from its fourth on, the pace
the answers go on at. At 64 streams every first event is in the top 1 %, and most of
the rest are the answers' last events: they all end in the same decode step, and each
end's work (its connections closed, its flow finished) delays the others' last events.
`--spread S` spreads the ends over S seconds more, as a batch's answers of different
lengths end. `--rounds N` measures every row N times, one round after
another, and gives each ratio as every round did: one run's CPU ratio moves by about
10 % either way, and a latency target is met in so many rounds of N. `--again` measures
a second plain mitmdump as a route of its own: its ratios to the first are what a
ratio moves by when nothing differs.

    .venv/bin/python -m scripts.bench.paced [--quick] [--streams 256,512,1024] [--workers 2,4,8]
        [--api chat|messages|responses] [--rounds 3] [--again] [--spread 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from addon.handoff.exact import asking_for_ids
from scripts.bench.splice import (
    MESSAGES,
    SseSource,
    cpu_seconds,
    read_stream,
    served,
    wait_for_tokenizers,
)
from scripts.parts.processes import running
from scripts.testbed.mitm import Mitmdump
from scripts.testbed.workers import SpilloverWorkers

PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
PLAIN_IDS = "plain, ids chunks"  # plain mitmdump, its client asking for the addon's ids
# A second plain mitmdump, measured as any other route is: what a ratio moves by when
# nothing differs, the yardstick each route's ratio is read against (`--again`).
PLAIN_AGAIN = "plain, again"


async def paced_streams(
    port: int, streams: int, rate: int, seconds: float, api: str = "chat", ids: bool = False,
    spread: float = 0.0,
) -> tuple[int, float, list[list[float]], list[float]]:  # fmt: skip
    """(events received, seconds until the last stream ended, each stream's latencies in
    ms, each stream's first event in ms after they were all asked); `ids`: the client
    asks for token ids as the addon does (exact.asking_for_ids); `spread`: the answers'
    ends spread over so many seconds more (the k-th of n runs k/n of it longer), where
    with none they all end in the same decode step."""
    latencies: list[list[float]] = [[] for _ in range(streams)]
    firsts: list[float] = []
    start = time.perf_counter()
    counts = await asyncio.gather(
        *(
            read_stream(port, paced_body(rate, seconds + spread * k / streams, api, ids), each,
                        firsts, PATHS[api])
            for k, each in enumerate(latencies)
        )
    )  # fmt: skip
    took = time.perf_counter() - start
    return sum(counts), took, latencies, [1000 * (first - start) for first in firsts]


def paced_body(rate: int, seconds: float, api: str, ids: bool) -> dict[str, Any]:
    """The request of one answer of `seconds` at `rate` events a second."""
    body: dict[str, Any] = {
        "stream": True, "max_tokens": int(rate * seconds), "interval_ms": 1000 / rate,
        "messages": MESSAGES, "model": "bench",
    }  # fmt: skip
    if api == "responses":
        body = {**body, "input": MESSAGES[0]["content"], "max_output_tokens": body["max_tokens"]}
        del body["messages"], body["max_tokens"]
    return asking_for_ids(body) if ids else body


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


# asked ev/s, got ev/s, p50, p99, proxy cores, proxy CPU s per 10,000 events, MiB per
# 1,000 open streams (the proxy's resident memory at its most in the row, over idle),
# the last stream's first event (ms after all were asked: a connection the proxy's
# listening queue dropped starts on its client's retry, a second later), the p99 of
# each stream's events after its first STARTING
Row = tuple[float, float, float, float, float, float, float, float, float]
STARTING = 3


def resident_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


def measure(
    port: int, pids: Callable[[], list[int]], streams: int, rate: int, seconds: float, api: str,
    ids: bool = False, spread: float = 0.0,
) -> Row:  # fmt: skip
    asyncio.run(paced_streams(port, min(streams, 8), rate, 0.5, api, ids))  # warm up
    used, idle = cpu_seconds(pids()), resident_mib(pids())
    most = [idle]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.1):
            most.append(resident_mib(pids()))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    events, took, each, firsts = asyncio.run(
        paced_streams(port, streams, rate, seconds, api, ids, spread)
    )
    done.set()
    sampler.join()
    cpu = cpu_seconds(pids()) - used
    latencies = [ms for stream in each for ms in stream]
    going = [ms for stream in each for ms in stream[STARTING:]]
    return (
        streams * rate * (seconds + spread / 2) / (seconds + spread),  # on average
        events / took,
        percentile(latencies, 0.5),
        percentile(latencies, 0.99),
        cpu / took,
        1e4 * cpu / max(events, 1),
        1000 * (max(most) - idle) / streams,
        max(firsts, default=float("nan")),
        percentile(going, 0.99),
    )


@contextmanager
def route(
    name: str, source: SseSource, twin: SseSource, work: Path
) -> Iterator[tuple[int, Callable[[], list[int]]]]:
    """The port a row's client talks to, and its proxy's processes; `twin` is the
    fallback with the same tokenizer that makes the "addon, ids" row ask for token ids."""
    if name == "direct":
        yield source.port, list
        return
    if name.startswith("workers "):
        pool = SpilloverWorkers(source.url, [], count=int(name.split()[1]), log_dir=work)
        with running(pool):
            yield pool.port, pool.pids
        return
    fallbacks = [twin.url] if name == "addon, ids" else []
    proxy = Mitmdump(source.url, fallbacks, addon=not name.startswith("plain"), log_dir=work)
    with running(proxy):
        if fallbacks:
            wait_for_tokenizers(proxy)
        yield proxy.port, lambda: [proxy.pid]


def report(rows: dict[tuple[int, str], Row], counts: list[int], names: list[str]) -> list[str]:
    """Each row absolute and over direct (the latency the route adds), then each route
    against plain mitmdump as ratios."""
    heads = ("asked/s", "got/s", "got %", "p50 ms", "p99 ms", "+p50 ms", "+p99 ms", "cores")
    heads += ("cpu/10k", "MiB/1k", "1st max", "p99 4th+")
    lines = [f"{'streams':>7}  {'route':16} " + " ".join(f"{h:>8}" for h in heads)]
    for (streams, name), (asked, got, p50, p99, cores, cpu, mib, first, going) in rows.items():
        direct = rows[streams, "direct"]
        lines.append(
            f"{streams:7}  {name:16} {asked:8.0f} {got:8.0f} {100 * got / asked:8.1f} "
            f"{p50:8.2f} {p99:8.2f} {p50 - direct[2]:8.2f} {p99 - direct[3]:8.2f} {cores:8.2f} "
            f"{cpu:8.3f} {mib:8.1f} {first:8.0f} {going:8.2f}"
        )
    return lines + ratio_lines([rows], counts, names)


def ratios(rows: dict[tuple[int, str], Row], streams: int, name: str) -> dict[str, float]:
    """A route against plain mitmdump (PLAIN_IDS: the ids row against it, by CPU)."""
    plain = rows[streams, "plain mitmdump"]
    if name == PLAIN_IDS:
        same, row = rows[streams, PLAIN_IDS], rows[streams, "addon, ids"]
        return {"CPU per event": row[5] / same[5], "plain's own carrying them": same[5] / plain[5]}
    row, direct = rows[streams, name], rows[streams, "direct"]
    return {
        "delivered": row[1] / plain[1], "p50": row[2] / plain[2], "p99": row[3] / plain[3],
        "added p99": (row[3] - direct[3]) / (plain[3] - direct[3]),
        "p99 4th+": row[8] / plain[8], "CPU per event": row[5] / plain[5],
    }  # fmt: skip


def ratio_lines(
    rounds: list[dict[tuple[int, str], Row]], counts: list[int], names: list[str]
) -> list[str]:
    """Each route against plain mitmdump, each ratio as every round gave it."""
    lines = []
    for streams in counts:
        for name in names[2:]:
            over = f"addon, ids / {PLAIN_IDS}" if name == PLAIN_IDS else f"{name} / plain mitmdump"
            each = [ratios(rows, streams, name) for rows in rounds]
            said = ", ".join(
                f"{key} " + " ".join(f"{r[key]:.2f}" for r in each) + "x" for key in each[0]
            )
            lines.append(f"{streams} streams, {over}: {said}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 s per row, 16 and 64 streams")
    parser.add_argument("--streams", default="256,512,1024", help="stream counts, comma-separated")
    parser.add_argument("--rate", type=int, default=40, help="events per second per stream")
    parser.add_argument("--seconds", type=float, default=8, help="how long each row streams")
    parser.add_argument(
        "--workers", default="", help="worker counts behind HAProxy, a row each (e.g. 2,4,8)"
    )
    parser.add_argument("--no-ids", action="store_true", help="leave out the 'addon, ids' row")
    parser.add_argument(
        "--again", action="store_true", help="a second plain mitmdump row: the ratios' own noise"
    )
    parser.add_argument(
        "--spread", type=float, default=0.0,
        help="the answers' ends spread over so many seconds (by default all end at once)",
    )  # fmt: skip
    parser.add_argument("--api", choices=list(PATHS), default="chat", help="the API streamed")
    parser.add_argument(
        "--rounds", type=int, default=1, help="every row measured this many times, in turn"
    )
    args = parser.parse_args()
    counts = [16, 64] if args.quick else [int(n) for n in args.streams.split(",")]
    seconds = 3 if args.quick else args.seconds
    ids = not args.no_ids and args.api == "chat"
    names = ["direct", "plain mitmdump", "addon", *(["addon, ids", PLAIN_IDS] if ids else [])]
    names += [f"workers {n}" for n in filter(None, args.workers.split(","))]
    names += [PLAIN_AGAIN] if args.again else []
    # thousands of sockets: the client's, and every proxy's (they inherit the limit)
    _, most = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (most, most))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        source, twin = SseSource(log_dir=work), SseSource(log_dir=work)
        with running(source, twin):
            rounds = [
                measure_rows(names, counts, source, twin, work, args, seconds)
                for _ in range(max(1, args.rounds))
            ]
    ends = f", their ends spread over {args.spread:g} s more" if args.spread else ""
    print(
        f"{args.api}: {args.rate} events/s per stream, {seconds:g} s per row{ends}, "
        f"{os.cpu_count()} cores shared"
    )
    for number, rows in enumerate(rounds, 1):
        if len(rounds) > 1:
            print(f"round {number} of {len(rounds)}:")
        print("\n".join(report(rows, counts, names)))
    if len(rounds) > 1:
        print(f"every round, in order ({len(rounds)}):")
        print("\n".join(ratio_lines(rounds, counts, names)))


def measure_rows(
    names: list[str], counts: list[int], source: SseSource, twin: SseSource, work: Path,
    args: argparse.Namespace, seconds: float,
) -> dict[tuple[int, str], Row]:  # fmt: skip
    """One round: every route's rows, one route after another."""
    rows: dict[tuple[int, str], Row] = {}
    for name in names:
        with route(name, source, twin, work) as (port, pids):
            before = served(source)["with_ids"]
            for streams in counts:
                rows[streams, name] = measure(
                    port, pids, streams, args.rate, seconds, args.api, name == PLAIN_IDS,
                    args.spread,
                )  # fmt: skip
            asked_ids = served(source)["with_ids"] > before
            if asked_ids != (name in ("addon, ids", PLAIN_IDS)):
                raise RuntimeError(f"row {name!r} did not take its path (token ids: {asked_ids})")
    return rows


if __name__ == "__main__":
    main()
