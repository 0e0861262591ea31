"""A burst of new connections is taken in whole while the proxy is busy: a real mitmdump
with the addon, stopped (SIGSTOP) so that it accepts nothing, is sent more connections at
once than asyncio's own listening queue holds (100); the kernel completes every
handshake into the proxy's deeper queue, where asyncio's would drop the rest (their
clients retry a second later). Plain mitmdump, asked the same, drops them."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from addon.surface.listenqueue import BACKLOG, listen_deeper
from scripts.testbed.mitm import Mitmdump

BURST = 300  # more than asyncio's 100, less than the proxy's 2048


@pytest.fixture(scope="module")
def depth() -> int:
    """How deep the proxy's queue can be here (the kernel caps it at somaxconn)."""
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    if somaxconn <= 100:
        pytest.skip(f"net.core.somaxconn is {somaxconn}: no queue here is deeper than asyncio's")
    return min(BACKLOG, somaxconn)


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def handshakes_completed(port: int) -> int:
    """How many of BURST connections to `port` the kernel completes within a second,
    with nobody accepting them."""
    socks: list[socket.socket] = []
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
        for sock in socks:
            sock.close()


def test_a_burst_of_connections_is_taken_in_whole_while_the_proxy_is_busy(
    depth, primary, start_proxy, server_logs
) -> None:
    proxy = start_proxy(primary.url, [])
    with stopped(proxy.pid):
        # The kernel takes one more than the depth.
        assert handshakes_completed(proxy.port) == min(BURST, depth + 1)
    plain = Mitmdump(primary.url, [], addon=False, log_dir=server_logs).start()
    try:
        with stopped(plain.pid):
            taken = handshakes_completed(plain.port)
    finally:
        plain.stop()
    assert taken < BURST, "plain mitmdump listens deep too now: the addon's deepening is moot"


def test_only_the_named_ports_are_deepened(depth) -> None:
    named, other = socket.socket(), socket.socket()
    local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with named, other, local:
        local.bind(f"\0spillover-listenqueue-{os.getpid()}")
        for sock in (named, other, local):
            if sock is not local:
                sock.bind(("127.0.0.1", 0))
            sock.listen(5)
        port = named.getsockname()[1]
        assert listen_deeper({port}) == {port}  # (a UNIX socket listening beside is passed)
        assert handshakes_completed(port) == min(BURST, depth + 1)
        assert handshakes_completed(other.getsockname()[1]) == 6
