"""Which processes listen on a local TCP port: the listening socket's inode (from the
kernel's sock_diag, or /proc/net/tcp{,6}) -> the processes holding it, and, when none
can be read, whose they are."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import SplitResult, urlsplit

from watchers.sockdiag import listening

LIVE_PROC = Path("/proc")  # this machine's: its sockets can be asked of the kernel
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")


@dataclass(frozen=True)
class Listeners:
    listening: bool  # a socket in this network namespace listens on the port
    pids: frozenset[int]  # the processes holding it
    unreadable: frozenset[int]  # processes of the socket's owner whose descriptors we may not read


def port_of(url: str | SplitResult) -> int:
    """The port a server's URL names, or its scheme's own (an https URL without one: 443)."""
    parts = urlsplit(url) if isinstance(url, str) else url
    return parts.port or (443 if parts.scheme == "https" else 80)


def find_listeners(port: int, proc: Path = LIVE_PROC) -> Listeners:
    """Who holds a socket listening on `port` (IPv4 or IPv6, any address)."""
    return ListenerScans(proc).find(port)


@dataclass(frozen=True)
class _Scan:
    inodes: frozenset[str]  # the port's listening sockets, as descriptors link to them
    found: Listeners
    seen: frozenset[int]  # every process there was


class ListenerScans:
    """`find_listeners` for ports looked up again and again. The first lookup of a port
    reads every process's descriptors (tens of thousands on a GPU box, on a thread the
    event loop shares the interpreter with); while the port's sockets stay the same ones
    and every process found holding them still does, a later lookup reads only those
    processes' descriptors and those of the processes started since. Anything else (a
    holder gone, a new socket) reads them all again.
    (Lookups on several threads at once each read what they need: each port's last scan
    is replaced whole.)"""

    def __init__(self, proc: Path = LIVE_PROC) -> None:
        self.proc = proc
        self._last: dict[int, _Scan] = {}

    def find(self, port: int) -> Listeners:
        sockets = listening() if self.proc == LIVE_PROC else None
        if sockets is None:
            sockets = listed(self.proc)
        inodes = frozenset(f"socket:[{inode}]" for at, _, inode in sockets if at == port)
        uids = {uid for at, uid, _ in sockets if at == port}
        if not inodes:
            self._last.pop(port, None)
            return Listeners(False, frozenset(), frozenset())
        pids = frozenset(int(name) for name in os.listdir(self.proc) if name.isdigit())
        last = self._last.get(port)
        found = None
        if last is not None and last.inodes == inodes:
            found = _still_held(self.proc, last.found, pids, last.seen, inodes, uids)
        if found is None:
            found = _holders(self.proc, pids, inodes, uids)
        self._last[port] = _Scan(inodes, found, pids)
        return found


def _still_held(
    proc: Path,
    last: Listeners,
    pids: frozenset[int],
    seen: frozenset[int],
    inodes: frozenset[str],
    uids: set[int],
) -> Listeners | None:
    """The holders among those `last` found and the processes started since (`pids` now,
    `seen` then); None where one that held the sockets no longer does. Those that were
    not ours to read still are not, while they run."""
    found = _holders(proc, last.pids | (pids - seen), inodes, uids)
    if not last.pids <= found.pids:
        return None
    return replace(found, unreadable=found.unreadable | (last.unreadable & pids))


def _holders(proc: Path, pids: frozenset[int], inodes: frozenset[str], uids: set[int]) -> Listeners:
    """Which of `pids` hold any of `inodes`; those whose descriptors we may not read and
    that run as one of `uids` (the sockets' owners) are told apart."""
    holders, unreadable = set(), set()
    for pid in (proc / str(pid) for pid in pids):
        try:
            fds = list((pid / "fd").iterdir())
        except PermissionError:
            _not_ours(pid, uids, unreadable)
            continue
        except OSError:
            continue  # gone
        for fd in fds:
            try:
                target = os.readlink(fd)
            except PermissionError:  # listed, but not ours to follow (root without
                _not_ours(pid, uids, unreadable)  # CAP_SYS_PTRACE in a container)
                break
            except OSError:
                continue  # closed meanwhile: one vanished descriptor must not hide the rest
            if target in inodes:
                holders.add(int(pid.name))
                break
    return Listeners(True, frozenset(holders), frozenset(unreadable))


class ListeningPids:
    """Who listens on a server's port on this machine, looked up again once `fresh_s` has
    passed (see ListenerScans for what a lookup reads; `scans`, where its owner looks the
    same ports up too, so each lookup builds on the last either made)."""

    def __init__(
        self, fresh_s: float, proc: Path = LIVE_PROC, scans: ListenerScans | None = None
    ) -> None:
        self.fresh_s = fresh_s
        self._scans = scans or ListenerScans(proc)
        self._known: dict[int, tuple[float, frozenset[int]]] = {}  # port -> (when, pids)

    def of(self, url: str) -> frozenset[int] | None:
        """The processes listening on `url`'s port; None for another machine's server."""
        parts = urlsplit(url)
        if parts.hostname not in LOCAL_HOSTS:
            return None
        port = port_of(parts)
        known = self._known.get(port)
        if known is None or time.monotonic() - known[0] >= self.fresh_s:
            known = (time.monotonic(), self._scans.find(port).pids)
            self._known[port] = known
        return known[1]

    def forget(self, url: str) -> None:
        """Look `url`'s listeners up afresh next time (those known are gone)."""
        self._known.pop(port_of(url), None)


def listed(proc: Path) -> list[tuple[int, int, int]]:
    """(port, uid, inode) of the listening sockets /proc/net/tcp{,6} list (every socket
    of the namespace is listed there: read where the kernel cannot be asked)."""
    found = []
    for table in ("net/tcp", "net/tcp6"):
        try:
            lines = (proc / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":
                found.append((int(fields[1].rsplit(":", 1)[1], 16), int(fields[7]), int(fields[9])))
    return found


def _not_ours(pid: Path, uids: set[int], unreadable: set[int]) -> None:
    """A process whose descriptors we may not read: noted if it runs as the socket's owner."""
    try:
        if pid.stat().st_uid in uids:
            unreadable.add(int(pid.name))
    except OSError:
        pass


def listening_pids(port: int, proc: Path = Path("/proc")) -> set[int]:
    """Processes with a TCP socket listening on `port`."""
    return set(find_listeners(port, proc).pids)


def descendants(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """The processes `pid` started, and theirs (from each thread's `children` list). An
    engine such as vLLM serves HTTP from one process and holds the card from others."""
    found: list[int] = []
    for task in (proc / str(pid) / "task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            found += [child, *descendants(child, proc)]
    return found
