"""How a real llama-server's memory moves while it loads a real model (Gemma 3 270M):
its resident memory sampled every 20 ms from exec until /health answers. The longest
pause within the load bounds how long a card must hold still before its level is taken
as its rest (`spillover_settle_s`, docs/memory.md).

    python -m scripts.bench.loadpause [--ctx 2048 32768]
"""

from __future__ import annotations

import argparse
import subprocess
import time

import httpx

from scripts.parts.processes import free_port
from scripts.testbed.llamaserver import ensure_binary
from scripts.testbed.realmodel import gemma

MOVE_MIB = 1.0  # a change this big counts as the memory moving


def resident_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def trace(ctx: int) -> str:
    port = free_port()
    argv = [str(ensure_binary()), "-m", str(gemma()), "--port", str(port), "-c", str(ctx)]
    server = subprocess.Popen(
        [*argv, "--no-mmap", "-t", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    start, samples = time.monotonic(), []
    try:
        while True:
            samples.append((time.monotonic() - start, resident_mib(server.pid)))
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.2).is_success:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
    finally:
        server.terminate()
        server.wait()
    healthy = samples[-1][0]
    moved_at, level, longest, moves = samples[0][0], samples[0][1], 0.0, 0
    for at, mib in samples:
        if abs(mib - level) >= MOVE_MIB:
            longest, moved_at, level, moves = max(longest, at - moved_at), at, mib, moves + 1
    return (
        f"ctx {ctx}: /health after {healthy:.2f} s; resident {samples[0][1]:,.0f} -> "
        f"{samples[-1][1]:,.0f} MiB in {moves} moves; longest pause within the load "
        f"{longest * 1000:,.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctx", type=int, nargs="+", default=[2048, 32768])
    for ctx in parser.parse_args().ctx:
        print(trace(ctx), flush=True)


if __name__ == "__main__":
    main()
