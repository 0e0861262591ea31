"""What tells a loaded server from a hung one: the CPU its processes use, read from
/proc of real processes listening on real ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from watchers.cputime import ServerProcesses, cpu_seconds

# Listens on a port, then works (a loaded server's event loop) or waits (a hung one's).
SERVER = """
import socket, sys, time
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
while True:
    if sys.argv[1] == "works":
        sum(range(1000))
    else:
        time.sleep(1)
"""


@contextmanager
def server(tmp_path: Path, how: str) -> Iterator[tuple[int, str]]:
    """(pid, URL) of a process that `how` ("works" or "waits"), run under a name with
    spaces and parentheses (its /proc/PID/stat spells the name between parentheses)."""
    program = tmp_path / f"srv ({how}) x"
    program.symlink_to(sys.executable)
    process = subprocess.Popen([program, "-c", SERVER, how], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        yield process.pid, f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()


def test_a_working_server_is_told_from_a_waiting_one(tmp_path: Path) -> None:
    processes = ServerProcesses()
    with server(tmp_path, "works") as (pid, url):
        assert (Path(f"/proc/{pid}/comm").read_text().strip()) == "srv (works) x"
        assert processes.working(url, 0.3) is True
        os.kill(pid, signal.SIGSTOP)  # the same process, stopped
        assert processes.working(url, 0.3) is False
        os.kill(pid, signal.SIGCONT)
    with server(tmp_path, "waits") as (pid, url):
        assert processes.working(url, 0.3) is False
        assert processes.working(url.replace("127.0.0.1", "localhost"), 0.3) is False


def test_what_cannot_be_told_is_none(tmp_path: Path) -> None:
    processes = ServerProcesses()
    assert processes.working("http://gpu-box-2:8080", 0.1) is None  # another machine's
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    assert processes.working(f"http://127.0.0.1:{port}", 0.1) is None  # nobody listens
    with server(tmp_path, "waits") as (pid, url):
        assert processes.working(url, 0.1) is False
    assert processes.working(url, 0.1) is None  # it ended: its pid is no more
    assert cpu_seconds(frozenset({pid})) is None
