"""A mitmproxy addon for finding where memory goes (the soak's `--trace-memory`).

Loaded after the spillover addon (`-s scripts/bench/memtrace.py --set memtrace_file=PATH`), it
traces allocations from the start; each SIGUSR1 takes a snapshot, and from the second
on writes to `memtrace_file` the places whose allocations grew most since the first.
"""

from __future__ import annotations

import asyncio
import signal
import tracemalloc
from pathlib import Path

from mitmproxy import ctx

FRAMES = 12
TOP = 15


class MemTrace:
    def __init__(self) -> None:
        self.baseline: tracemalloc.Snapshot | None = None

    def load(self, loader) -> None:
        loader.add_option(
            "memtrace_file", str, "", "Where the growth since the first snapshot goes."
        )
        tracemalloc.start(FRAMES)

    def running(self) -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, self.snapshot)

    def snapshot(self) -> None:
        taken = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__)]
        )
        if self.baseline is None:
            self.baseline = taken
            return
        grown = taken.compare_to(self.baseline, "traceback")[:TOP]
        lines = []
        for stat in grown:
            lines.append(f"{stat.size_diff / 1024:+.1f} KiB in {stat.count_diff:+d} blocks")
            lines += [f"    {line}" for line in stat.traceback.format()[-6:]]
        Path(ctx.options.memtrace_file).write_text("\n".join(lines) + "\n")


addons = [MemTrace()]
