"""Benchmark: one huge SSE event must not starve the other streams.

Against the stand-in server (scripts/testbed/sse_source.py), side by side in one run: direct,
plain mitmdump (streaming) and mitmdump with the addon. For each, the per-chunk latency
of 4 paced streams (500 chunks/s each) alone, then while one more stream sends a single
event of 100 MiB; and how that stream ended and how long it took. The addon refuses an
event over its limit (16 MiB) as garbled and hands the answer off to its fallback (the
stand-in itself here).

    .venv/bin/python -m scripts.bench.bigevent [--mib 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from addon.servers.framing import ChunkedBody
from scripts.bench.splice import SseSource, read_stream
from scripts.parts.processes import running
from scripts.testbed.mitm import Mitmdump

PACED = {"stream": True, "max_tokens": 1500, "interval_ms": 2, "messages": []}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):  # the peak: a big event is gone by the end
            return int(line.split()[1]) / 1024
    return float("nan")


async def paced_latencies(port: int, big_mib: int) -> tuple[list[float], tuple[float, str] | None]:
    """Latencies of 4 paced streams; with `big_mib`, and the big stream's seconds."""
    samples: list[float] = []
    paced = [read_stream(port, PACED, samples) for _ in range(4)]
    if not big_mib:
        await asyncio.gather(*paced)
        return samples, None
    started = time.perf_counter()
    big = {"stream": True, "max_tokens": 20, "big_event_mib": big_mib, "messages": []}

    async def timed_big() -> tuple[float, str]:
        ending = await drain(port, big)
        return time.perf_counter() - started, ending

    *_, took = await asyncio.gather(*paced, timed_big())
    return samples, took


async def drain(port: int, body: dict) -> str:
    """Read a stream to its end without looking into it (a client that parsed a 100 MiB
    event would be the bottleneck itself); say how it ended."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
        % (len(payload), payload)
    )
    await reader.readuntil(b"\r\n\r\n")
    decoder, tail, size = ChunkedBody(), b"", 0
    while not decoder.complete and (data := await reader.read(1 << 20)):
        out = decoder.feed(data)
        size += len(out)
        tail = (tail + out)[-4096:]
    writer.close()
    ending = "[DONE]" if b"[DONE]" in tail else "in-band error" if b'"error"' in tail else "cut"
    return f"{size / 2**20:.0f} MiB, {ending}"


def quantiles(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return samples[len(samples) // 2], samples[int(len(samples) * 0.95)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=100, help="size of the big event")
    mib = parser.parse_args().mib
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # The twin is a fallback with the same tokenizer (never the primary's own address).
        source, twin = SseSource(log_dir=work), SseSource(log_dir=work)
        with running(source, twin):
            setups = {
                "direct": None,
                "plain mitmdump": Mitmdump(source.url, addon=False, log_dir=work),
                "addon": Mitmdump(source.url, [twin.url], log_dir=work),
            }
            print(
                f"{'':16} {'alone p50/p95 ms':>18} {'beside big p50/p95 ms':>22} "
                f"{'p95 ratio':>9} {'peak RSS MiB':>12}  big stream"
            )
            for name, proxy in setups.items():
                if proxy is not None:
                    proxy.start()
                    if proxy.addon:
                        proxy.servers_known()
                port = proxy.port if proxy else source.port
                try:
                    alone = quantiles(asyncio.run(paced_latencies(port, 0))[0])
                    beside, big = asyncio.run(paced_latencies(port, mib))
                    peak = rss_mib(proxy.pid) if proxy else float("nan")
                finally:
                    if proxy is not None:
                        proxy.stop()
                near = quantiles(beside)
                assert big is not None
                print(
                    f"{name:16} {alone[0]:8.3f}/{alone[1]:<9.3f} {near[0]:10.3f}/{near[1]:<11.3f} "
                    f"{near[1] / alone[1]:9.2f} {peak:12.0f}  {big[0]:.2f} s, {big[1]}"
                )


if __name__ == "__main__":
    main()
