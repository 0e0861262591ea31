"""Child processes that serve HTTP on a loopback port: start, wait healthy, always stop.

Each child's output goes to a log file whose tail is shown when it fails to come up.
Children get PR_SET_PDEATHSIG, so even a SIGKILLed parent leaves none behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

_PR_SET_PDEATHSIG = 1


class ServerFailed(RuntimeError):
    pass


# Ports are chosen below the kernel's ephemeral range, which every outgoing connection
# takes its local port from, as bind(0) does: a port that bind(0) gave back could be any
# connection's before the child binds it, and a test run makes tens of thousands. Each
# pytest-xdist worker chooses in a slice of its own, so no two choose the same port.
_SLICES = 16
_FLOOR = 10000
_given: set[tuple[str, int]] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing listens on, nor takes for a connection meanwhile."""
    low, high = _this_slice()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if len(_given) > (high - low) // 2:
        _given.clear()  # (the oldest are long closed)
    for _ in range(64 if high > low else 0):
        port = random.randrange(low, high)
        if (host, port) in _given:
            continue
        with socket.socket(family) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _given.add((host, port))
        return port
    with socket.socket(family) as sock:  # no room below the range: the kernel's choice
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _this_slice() -> tuple[int, int]:
    """This process's ports: its worker's slice of those from _FLOOR to the ephemeral
    range (a process outside pytest-xdist: one by its pid); (0, 0) where none is known."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0, 0
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) if worker[2:].isdigit() else os.getpid()
    width = max(ephemeral - _FLOOR, 0) // _SLICES
    low = _FLOOR + (index % _SLICES) * width
    return low, low + width


def die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ManagedProcess:
    """A child process listening on `host`:`port` (a loopback address: 127.0.0.2 stands
    for another machine in the fleet tests), healthy when `health_path` says 200."""

    name = "server"
    health_path = "/health"
    scheme = "http"
    verify: ssl.SSLContext | bool = True  # how its certificate is checked, behind TLS

    def __init__(
        self, port: int | None = None, log_dir: Path | None = None, host: str = "127.0.0.1"
    ) -> None:
        self.host = host
        self._port_chosen = port is None  # (another one is tried if it is taken meanwhile)
        self.port = port or free_port(host)
        log_dir = Path(log_dir or tempfile.gettempdir())
        self.log_path = log_dir / f"{self.name}-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address
        return f"{self.scheme}://{host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} not started"
        return self.process.pid

    def argv(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str] | None:
        """The child's environment; None inherits this process's."""
        return None

    def start(self, timeout: float = 30.0):
        """Launch and wait until healthy. A port picked here can be taken by another
        process before the child binds it: then another port is tried, twice at most."""
        for attempt in range(3):
            self.launch()
            try:
                self.wait_healthy(timeout)
                return self
            except ServerFailed:
                taken = "already in use" in self.log_tail(40).lower()
                if not (taken and self._port_chosen and attempt < 2):
                    raise
            self.stop()
            self.port = free_port(self.host)
            self.log_path = self.log_path.with_name(f"{self.name}-{self.port}.log")
        return self

    def launch(self) -> None:
        """Start the process without waiting for it. It dies with the thread that
        launched it (PR_SET_PDEATHSIG is per thread): launch from one that lives on."""
        argv = self.argv()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                preexec_fn=die_with_parent,
            )

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise ServerFailed(
                    f"{self.name} exited with {self.process.returncode} while starting:\n"
                    + self.log_tail()
                )
            with contextlib.suppress(httpx.TransportError):
                if (
                    httpx.get(
                        self.url + self.health_path, timeout=1.0, verify=self.verify
                    ).status_code
                    == 200
                ):
                    return
            time.sleep(0.02)
        self.stop()
        raise ServerFailed(f"{self.name} not healthy after {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL, as the kernel's OOM killer or a driver fault would."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()


@contextlib.contextmanager
def running(
    *processes: ManagedProcess, timeout: float = 30.0
) -> Iterator[tuple[ManagedProcess, ...]]:
    """Start every process (each healthy within `timeout`), yield them, stop them all
    whatever happens."""
    try:
        for process in processes:
            process.start(timeout)
        yield processes
    finally:
        for process in processes:
            process.stop()
