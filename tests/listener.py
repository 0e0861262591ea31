"""A server process of its own that opened no device file, for the tests that map a
listening port to its cards through the real /proc: the test process itself may hold
/dev/nvidia<N> (NVML, asked by earlier tests on a machine with an NVIDIA card), which
rightly maps it to a card and not to RAM."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

LISTENER = (
    "import socket, sys; s = socket.create_server(('127.0.0.1', 0)); "
    "print(s.getsockname()[1], flush=True); sys.stdin.read()"
)


@contextmanager
def listening_process() -> Iterator[tuple[int, int]]:
    """(pid, port) of a fresh Python process listening on 127.0.0.1."""
    server = subprocess.Popen(
        [sys.executable, "-c", LISTENER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        yield server.pid, int(server.stdout.readline())
    finally:
        server.kill()
        server.wait()
