"""`spillover run --workers N` as the tests and benchmarks start it: HAProxy on the port,
N whole proxies behind it (scripts/workers/pool.py)."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scripts.parts.processes import ManagedProcess, ServerFailed
from scripts.testbed.mitm import Mitmdump
from scripts.workers.pool import HaproxyMissing, haproxy_binary


def haproxy_missing() -> str | None:
    """Why the workers cannot run here (no HAProxy), for a test's skip; None if they can."""
    try:
        haproxy_binary()
    except HaproxyMissing as why:
        return str(why)
    return None


class SpilloverWorkers(ManagedProcess):
    name = "spillover-workers"
    health_path = "/spillover/health"

    def __init__(
        self,
        primary: str,
        fallbacks: Sequence[str] = (),
        *,
        count: int = 2,
        options: Sequence[str] = (),
        flags: Sequence[str] = (),
        log_dir: Path | None = None,
    ) -> None:
        """`flags`: more of `spillover run`'s own (such as --transparent)."""
        super().__init__(None, log_dir)
        self.flags = list(flags)
        self.primary = primary
        self.fallbacks = list(fallbacks)
        self.count = count
        self.options = list(options)

    def argv(self) -> list[str]:
        argv = [
            sys.executable, "-m", "scripts.cli", "run", "--primary", self.primary,
            "--fallbacks", ",".join(self.fallbacks), "--workers", str(self.count),
            "--port", str(self.port), *self.flags, "--", "--set", "flow_detail=0",
        ]  # fmt: skip
        for option in self.options:
            argv += ["--set", option]
        return argv

    def start(self, timeout: float = 60.0) -> SpilloverWorkers:
        """Started, once HAProxy sends requests to every worker (the supervisor says so:
        before, requests may all go to the first worker up, or to the primary)."""
        self.launch()
        deadline = time.monotonic() + timeout
        ready = f"{self.count} workers up behind HAProxy"
        while ready not in self.log_path.read_text(errors="replace"):
            assert self.process is not None
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ServerFailed(f"{self.count} workers never came up:\n{self.log_tail()}")
            time.sleep(0.05)
        return self

    def workers(self) -> dict[int, int]:
        """{worker port: pid} of the running workers (children of the supervisor)."""
        found = {}
        for child in _children(self.pid):
            argv = _argv(child)
            if any("mitmdump" in arg for arg in argv[:2]):
                mode = next(arg for arg in argv if arg.startswith("reverse:"))
                found[int(mode.rsplit(":", 1)[1])] = child
        return found

    def worker_ports(self) -> list[int]:
        return sorted(self.workers())

    def pids(self) -> list[int]:
        """The supervisor's children: the workers and HAProxy."""
        return _children(self.pid)

    def servers_known(self, timeout: float = 30) -> list[dict[str, Any]]:
        """Each worker's servers, once it has learnt them (see Mitmdump.servers_known)."""
        known = []
        for port in self.worker_ports():
            worker = Mitmdump(self.primary, self.fallbacks, port=port)
            known.append(worker.servers_known(timeout))
        return known


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []
