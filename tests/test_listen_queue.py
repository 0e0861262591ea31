"""A burst of new connections is taken in whole while the proxy is busy: a real mitmdump
with the addon, stopped (SIGSTOP) so that it accepts nothing, is sent more connections at
once than asyncio's own listening queue holds (100); the kernel completes every
handshake into the proxy's deeper queue, where asyncio's would drop the rest (their
clients retry a second later). Plain mitmdump, asked the same, drops them."""

from __future__ import annotations

import os
import select
import signal
import socket
import time
from pathlib import Path

import pytest

from addon.surface.listenqueue import BACKLOG
from scripts.testbed.mitm import Mitmdump

BURST = 300  # more than asyncio's 100, less than the proxy's 2048


def handshakes_completed(port: int, pid: int) -> int:
    """How many of BURST connections to `port` the kernel completes within a second
    while process `pid` is stopped."""
    socks: list[socket.socket] = []
    os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(BURST):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
            socks.append(sock)
        poller = select.poll()
        for sock in socks:
            poller.register(sock, select.POLLOUT)
        done: set[int] = set()
        deadline = time.monotonic() + 1.0  # within the first SYN retry, a second on
        while len(done) < BURST and (left := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(left * 1000):
                poller.unregister(fd)
                done.add(fd)
        return sum(
            1 for s in socks
            if s.fileno() in done and not s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        )  # fmt: skip
    finally:
        os.kill(pid, signal.SIGCONT)
        for sock in socks:
            sock.close()


def test_a_burst_of_connections_is_taken_in_whole_while_the_proxy_is_busy(
    primary, start_proxy, server_logs
) -> None:
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    if somaxconn <= 100:
        pytest.skip(f"net.core.somaxconn is {somaxconn}: no queue here is deeper than asyncio's")
    proxy = start_proxy(primary.url, [])
    # The kernel takes one more than the depth; it caps the depth at somaxconn.
    assert handshakes_completed(proxy.port, proxy.pid) == min(BURST, min(BACKLOG, somaxconn) + 1)
    plain = Mitmdump(primary.url, [], addon=False, log_dir=server_logs).start()
    try:
        taken = handshakes_completed(plain.port, plain.pid)
    finally:
        plain.stop()
    assert taken < BURST, "plain mitmdump listens deep too now: the addon's deepening is moot"
