"""The addresses the services listen on: none may be a server's, and each must be free.

`clash` compares addresses as given (a server not started yet still owns its port);
`cannot_listen` tries the port itself and names who holds it, where /proc tells.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlsplit

from watchers.listeners import find_listeners, port_of

EVERY_ADDRESS = ("0.0.0.0", "::", "")


def address(text: str) -> tuple[str, int]:
    """HOST:PORT (or [V6]:PORT, or :PORT for loopback) -> (host, port)."""
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def server_address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "", port_of(parts)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def is_here(host: str) -> bool:
    """Whether `host` names this machine (an address of its own can be bound)."""
    if host in EVERY_ADDRESS or is_loopback(host):
        return True
    try:
        with socket.create_server((host, 0), family=_family(host)):
            return True
    except OSError:
        return False


def same_socket(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Whether two listeners would take one socket: one port, on one address, on two
    loopback addresses, or where one listens on every address of the machine the other's
    address is on."""
    if a[1] != b[1]:
        return False
    if a[0] == b[0] or (is_loopback(a[0]) and is_loopback(b[0])):
        return True
    wide = [host for host in (a[0], b[0]) if host in EVERY_ADDRESS]
    return bool(wide) and all(is_here(host) for host in (a[0], b[0]))


def clash(mine: tuple[str, int], servers: Iterable[str]) -> str | None:
    """The first server whose own address `mine` would take, or None."""
    return next((url for url in servers if same_socket(mine, server_address(url))), None)


def cannot_listen(host: str, port: int, ours: Iterable[str] = ()) -> str | None:
    """Why a listener could not take host:port here now, or None. A port held by one of
    the systemd units named in `ours` counts as free: a new install restarts them."""
    try:
        with socket.create_server((host, port), family=_family(host)):
            return None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            holders = find_listeners(port).pids
            if holders and all(_runs_in(pid, ours) for pid in holders):
                return None
        return listen_error(exc, host, port)


def listen_error(exc: OSError, host: str, port: int) -> str:
    """What binding host:port failed on, in words."""
    if exc.errno == errno.EADDRINUSE:
        return f"{host}:{port} is taken{held_by(port)}"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{host} is not an address of this machine"
    if exc.errno == errno.EACCES:
        return f"port {port} is below 1024: only root (or CAP_NET_BIND_SERVICE) may take it"
    return f"cannot listen on {host}:{port} ({exc.strerror})"


def held_by(port: int) -> str:
    """' by pid N (name), ...' for the processes listening on `port`, or why they are not
    named ('' where no process here holds it)."""
    found = find_listeners(port)
    if found.pids:
        return " by " + ", ".join(f"pid {pid} ({_comm(pid)})" for pid in sorted(found.pids))
    if found.unreadable:
        return " by another user's process (this user cannot see which)"
    return ""


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _runs_in(pid: int, units: Iterable[str]) -> bool:
    """Whether a process runs in one of these systemd units: the last part of its cgroup
    (of any hierarchy, where cgroup v1 has several)."""
    try:
        cgroups = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return False
    return any(line.rsplit("/", 1)[-1] in units for line in cgroups)
