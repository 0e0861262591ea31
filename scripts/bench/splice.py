"""Benchmark: what the addon costs when nothing goes wrong, and what a handoff costs.

Part 1, side by side in one run against a max-rate stand-in server (scripts/testbed/sse_source.py):
direct, plain mitmdump (streaming) and mitmdump with the addon (no fallback; a fallback
with the same tokenizer, so the first leg asks for token ids; the same with exact replay
off; the addon behind the fail-open guard); throughput with 1 and 32 streams,
per-chunk latency at 500 chunks/s, and short answers (three tokens, 64 asked at a time):
answers a second, and the proxy's CPU for each (its processes together), what an
answer's start and end cost. Each row checks with the stand-in that its requests
took the path it names.
Part 2, real llama-servers: time to the first token (short prompt, median of 30) direct,
through plain mitmdump and through the addon; the handoff pause a client sees (handoff
note -> first fallback chunk), cold (fresh fallback, empty prompt cache) and warm
(prompt cached), next to the fallback's own prompt time.

    .venv/bin/python -m scripts.bench.splice [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import httpx

from addon.servers.framing import ChunkedBody
from scripts.guard import GuardProcess
from scripts.parts.processes import ManagedProcess, running
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.mitm import Mitmdump
from scripts.testbed.tinymodels import ensure_models
from watchers import cputime

SENT = re.compile(rb'"sent_ns":(\d+)')


class SseSource(ManagedProcess):
    name = "sse-source"

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "scripts.testbed.sse_source", str(self.port)]


async def read_stream(
    port: int,
    body: dict,
    latencies: list[float] | None = None,
    firsts: list[float] | None = None,
    path: str = "/v1/chat/completions",
) -> int:
    """Stream one answer over a raw socket; count its chunks (and their latencies, and
    when its first chunk came: time.perf_counter())."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    writer.write(
        b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (path.encode(), len(payload), payload)
    )
    head = await reader.readuntil(b"\r\n\r\n")
    assert b"chunked" in head.lower(), head
    body = ChunkedBody()
    events, pending = 0, b""
    while not body.complete:
        data = await reader.read(262144)
        if not data:
            break
        now = time.perf_counter_ns()
        pending += body.feed(data)
        end = pending.rfind(b"\n\n") + 2  # count complete events only
        block, pending = pending[:end], pending[end:]
        if firsts is not None and not events and b'"sent_ns":' in block:
            firsts.append(time.perf_counter())
        events += block.count(b'"sent_ns":')
        if latencies is not None:
            latencies.extend((now - int(m)) / 1e6 for m in SENT.findall(block))
    writer.close()
    return events


# One real message: with none, the addon never asks for token ids (nothing to replay).
MESSAGES = [{"role": "user", "content": "Count to a thousand."}]


def cpu_seconds(pids: Iterable[int]) -> float:
    """User and system CPU time of these processes so far (none of them there: 0)."""
    return cputime.cpu_seconds(frozenset(pids)) or 0.0


async def throughput(port: int, streams: int, chunks: int) -> float:
    body = {"stream": True, "max_tokens": chunks, "messages": MESSAGES}
    start = time.perf_counter()
    counts = await asyncio.gather(*(read_stream(port, body) for _ in range(streams)))
    elapsed = time.perf_counter() - start
    assert all(c >= chunks for c in counts), counts
    return sum(counts) / elapsed


async def short_answers(port: int, count: int, at_once: int) -> float:
    """Answers a second, of `count` three-token answers asked `at_once` at a time: what an
    answer's start and end cost (an agent's tool calls are many short answers)."""
    body = {"stream": True, "max_tokens": 3, "messages": MESSAGES}
    slots = asyncio.Semaphore(at_once)

    async def one() -> int:
        async with slots:
            return await read_stream(port, body)

    start = time.perf_counter()
    counts = await asyncio.gather(*(one() for _ in range(count)))
    elapsed = time.perf_counter() - start
    assert all(c >= 3 for c in counts), counts
    return count / elapsed


async def latency(port: int, chunks: int) -> tuple[float, float]:
    samples: list[float] = []
    body = {"stream": True, "max_tokens": chunks, "interval_ms": 2, "messages": MESSAGES}
    await read_stream(port, body, samples)
    samples.sort()
    return samples[len(samples) // 2], samples[int(len(samples) * 0.95)]


def overhead(quick: bool, work: Path) -> None:
    single, multi, paced, short = (4000, 500, 300, 500) if quick else (40000, 3000, 1500, 3000)
    # The twin stands for a fallback with the same tokenizer (the addon refuses the
    # primary's own address as a fallback); it answers only the addon's questions.
    source, twin = SseSource(log_dir=work), SseSource(log_dir=work)
    with running(source, twin):
        behind = Mitmdump(source.url, [], log_dir=work)
        setups: dict[str, list[ManagedProcess]] = {
            "direct": [],
            "plain mitmdump": [Mitmdump(source.url, addon=False, log_dir=work)],
            "addon": [Mitmdump(source.url, [], log_dir=work)],
            # A fallback with the same tokenizer: the first leg is asked for token ids.
            "addon, ids": [Mitmdump(source.url, [twin.url], log_dir=work)],
            "addon, ids off": [
                Mitmdump(
                    source.url, [twin.url], options=["spillover_exact_replay=false"],
                    log_dir=work,
                )
            ],
            # The fail-open guard in front (scripts/guard.py): one more relay on the way.
            "addon, guarded": [
                behind, GuardProcess(behind.port, source.url.split("//")[1], log_dir=work)
            ],
        }  # fmt: skip
        results: dict[str, tuple[float, float, float, float, float, float]] = {}
        for name, processes in setups.items():
            with running(*processes):
                for proxy in processes:
                    if isinstance(proxy, Mitmdump) and proxy.fallbacks:
                        wait_for_tokenizers(proxy)
                port = processes[-1].port if processes else source.port
                pids = frozenset(process.pid for process in processes)
                before = served(source)
                asyncio.run(throughput(port, 1, 500))  # warm up
                one = asyncio.run(throughput(port, 1, single))
                many = asyncio.run(throughput(port, 32, multi))
                p50, p95 = asyncio.run(latency(port, paced))
                used = cpu_seconds(pids)
                answers = asyncio.run(short_answers(port, short, 64))
                per_answer = 1000 * (cpu_seconds(pids) - used) / short
            check_path(name, before, served(source))
            results[name] = (one, many, p50, p95, answers, per_answer)
    plain = results["plain mitmdump"]
    print(
        f"{'':16} {'1 stream ev/s':>14} {'32 streams ev/s':>16} {'p50 ms':>8} {'p95 ms':>8} "
        f"{'answers/s':>10} {'CPU ms/answer':>14}"
    )
    for name, (one, many, p50, p95, answers, per_answer) in results.items():
        print(
            f"{name:16} {one:14,.0f} {many:16,.0f} {p50:8.3f} {p95:8.3f} {answers:10,.0f} "
            f"{per_answer:14.2f}"
        )
    for name in ("addon", "addon, ids", "addon, ids off", "addon, guarded"):
        addon = results[name]
        print(
            f"{name} / plain mitmdump: throughput {addon[0] / plain[0]:.2f}x (1 stream), "
            f"{addon[1] / plain[1]:.2f}x (32 streams); added p50 latency "
            f"{addon[2] - plain[2]:+.3f} ms, p95 {addon[3] - plain[3]:+.3f} ms; short "
            f"answers {addon[4] / plain[4]:.2f}x a second, {addon[5] / plain[5]:.2f}x the CPU each"
        )
    print(f"plain mitmdump / direct: throughput {plain[0] / results['direct'][0]:.2f}x (1 stream)")


def served(source: SseSource) -> dict[str, int]:
    return httpx.get(f"{source.url}/bench/requests").json()


def check_path(row: str, before: dict[str, int], after: dict[str, int]) -> None:
    """Every stream of a row asked for token ids exactly when the row says so."""
    streams = after["streams"] - before["streams"]
    with_ids = after["with_ids"] - before["with_ids"]
    expected = streams if row == "addon, ids" else 0
    if streams == 0 or with_ids != expected:
        raise RuntimeError(
            f"row {row!r} did not take its path: {with_ids} of {streams} streams asked for "
            f"token ids, expected {expected}"
        )


def wait_for_tokenizers(proxy: Mitmdump) -> None:
    """Token ids are asked for only once the addon knows both tokenizers."""
    servers = proxy.servers_known()
    if not all(info.get("tokenizer") for info in servers.values()):
        raise RuntimeError(f"the addon learned no tokenizer for some of {list(servers)}")


def handoff_pause(proxy: Mitmdump, control: httpx.Client, cut: int = 100) -> tuple[float, float]:
    """(client-side pause, fallback prompt ms) for one handoff after `cut` chunks."""
    body = {
        "messages": [{"role": "user", "content": "Tell me a long story about the river."}],
        "max_tokens": 800,
        "temperature": 0,
        "stream": True,
    }
    note_at = first_after = None
    prompt_ms = None
    received = 0
    with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith(":"):
                note_at = time.perf_counter()
            elif line.startswith("data: {"):
                received += 1
                if note_at is not None and first_after is None:
                    first_after = time.perf_counter()
                chunk = json.loads(line[6:])
                prompt_ms = chunk.get("timings", {}).get("prompt_ms", prompt_ms)
                if received == cut:
                    control.post(f"{proxy.url}/spillover/handoff")
    assert note_at is not None and first_after is not None and prompt_ms is not None
    return (first_after - note_at) * 1000, prompt_ms


def first_token_ms(client: httpx.Client, url: str) -> float:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "stream": True}
    start = time.perf_counter()
    first = None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
        # Read to the end, as a client does: one left unread would close the connection.
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and '"content"' in line:
                first = time.perf_counter()
    if first is None:
        raise RuntimeError(f"no token from {url}")
    return (first - start) * 1000


def first_token(target: str, fallback: str, repeats: int, work: Path) -> dict[str, float]:
    """Median time to the first token from `target`, direct and through each proxy
    (interleaved): by route."""
    plain = Mitmdump(target, addon=False, log_dir=work)
    addon = Mitmdump(target, [fallback], log_dir=work)
    with running(plain, addon):
        wait_for_tokenizers(addon)
        urls = {"direct": target, "plain mitmdump": plain.url, "addon": addon.url}
        # One kept-alive client per route, as an SDK client is: making an httpx client
        # (its TLS context) costs tens of milliseconds, which timed the client, not the path.
        clients = {name: httpx.Client() for name in urls}
        for name, url in urls.items():
            first_token_ms(clients[name], url)  # warm up: connections, the prompt cache
        samples: dict[str, list[float]] = {name: [] for name in urls}
        for _ in range(repeats):
            for name, url in urls.items():
                samples[name].append(first_token_ms(clients[name], url))
    return {name: statistics.median(values) for name, values in samples.items()}


def first_tokens(llama: tuple[LlamaServer, LlamaServer], repeats: int, work: Path) -> None:
    """The first token from the stand-in (the proxies' own time) and from llama-server
    (theirs with llama-server's on the same cores)."""
    source, twin = SseSource(log_dir=work), SseSource(log_dir=work)
    with running(source, twin):
        stand_in = first_token(source.url, twin.url, repeats, work)
    real = first_token(llama[0].url, llama[1].url, repeats, work)
    columns = ("stand-in", "over direct", "llama-server", "over direct")
    print(f"\n{'first token, ms':16}" + "".join(f"{c:>14}" for c in columns))
    for name in stand_in:
        a, b = stand_in[name], real[name]
        cells = (a, a - stand_in["direct"], b, b - real["direct"])
        print(f"{name:16}" + "".join(f"{c:14.2f}" for c in cells))
    for medians, where in ((stand_in, "stand-in"), (real, "llama-server")):
        share = medians["addon"] - medians["plain mitmdump"]
        print(f"addon over plain mitmdump ({where}): {share:+.2f} ms")


def usable_again(proxy: Mitmdump, url: str, timeout: float = 10) -> None:
    """A restarted server is down to the addon until its /health answers again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = httpx.get(f"{proxy.url}/spillover/status").json()["routing"]["states"]
        if states[url]["state"] == "ok":
            return
        time.sleep(0.05)
    raise RuntimeError(f"{url} never came back")


def pauses(quick: bool, work: Path) -> None:
    models = ensure_models(work / "models")
    control = httpx.Client()
    repeats = 3 if quick else 8
    # 4,096-token slots, as real deployments have at least: the addon can then see from
    # the text's size alone that the rest of the answer fits on the fallback.
    primary = LlamaServer(models["primary"], ctx_size=16384, log_dir=work)
    fallback = LlamaServer(models["fallback"], ctx_size=16384, log_dir=work)
    results = {}
    with running(primary, fallback):
        first_tokens((primary, fallback), 30 if quick else 100, work)
        for replay, exact in (("token ids", "true"), ("text", "false")):
            options = [f"spillover_exact_replay={exact}"]
            proxy = Mitmdump(primary.url, [fallback.url], options=options, log_dir=work)
            with running(proxy):
                wait_for_tokenizers(proxy)
                cold = []
                for _ in range(repeats):
                    fallback.stop()  # a fresh fallback process: nothing in its prompt cache
                    fallback.start()
                    usable_again(proxy, fallback.url)
                    cold.append(handoff_pause(proxy, control))
                warm = [handoff_pause(proxy, control) for _ in range(repeats)]  # cached
            results[f"cold, {replay}"], results[f"warm, {replay}"] = cold, warm
    print(f"\n{'handoff':16} {'pause ms':>9} {'fallback prompt ms':>19} {'pause - prompt':>15}")
    for label, samples in results.items():
        pause = statistics.median(s[0] for s in samples)
        prompt = statistics.median(s[1] for s in samples)
        extra = statistics.median(s[0] - s[1] for s in samples)
        print(f"{label:16} {pause:9.2f} {prompt:19.2f} {extra:15.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer chunks, for a smoke run")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="spillover-bench-"))
    overhead(args.quick, work)
    pauses(args.quick, work)


if __name__ == "__main__":
    main()
