"""How many new connections the proxy's listening sockets hold until it accepts them.

asyncio listens 100 deep. More connections than that arriving at once (a batch client's
or a benchmark's hundreds) overflow the queue while the proxy is busy, and each one whose
handshake the kernel drops waits for its client's retry, a second later: 256 answers
asked at once on a 2-core VM had 70-90 connections dropped (nstat's
TcpExtListenOverflows) and those answers began a second late, through plain mitmdump as
through the addon. Once mitmproxy listens, its sockets are made as deep as uvicorn's
(vLLM's server), which the kernel caps at net.core.somaxconn.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

BACKLOG = 2048
FDS = Path("/proc/self/fd")


def listen_deeper(ports: set[int], backlog: int = BACKLOG) -> set[int]:
    """Listen `backlog` deep on this process's TCP sockets that listen on `ports`
    (through a duplicate of each: the queue is the socket's, shared); the ports
    deepened. Where /proc is not Linux's, none."""
    deepened: set[int] = set()
    try:
        names = os.listdir(FDS)
    except OSError:
        return deepened
    for name in names:
        try:
            if not os.readlink(FDS / name).startswith("socket:"):
                continue
            with socket.socket(fileno=os.dup(int(name))) as sock:
                if sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                listens = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                if sock.type != socket.SOCK_STREAM or not listens:
                    continue
                if (port := sock.getsockname()[1]) in ports:
                    sock.listen(backlog)
                    deepened.add(port)
        except (OSError, ValueError):
            continue  # closed meanwhile, or not a socket of ours to change
    return deepened
