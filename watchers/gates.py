"""Which cards a server uses, so only streams on a card under pressure are handed off.

Found automatically for servers on this machine: listening port -> process -> the cards
NVML or the DRM fdinfo counters show it on; a server on no GPU computes in system RAM.
An explicit mapping (`spillover_cards`) wins, and is the only way for remote servers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from urllib.parse import urlsplit

from watchers.meminfo import CARD as RAM

REFRESH_SECONDS = 10.0


def parse_card_map(text: str) -> dict[str, set[str]]:
    """ "URL=card+card,URL=card" -> {URL: {cards}}; raises ValueError on a malformed entry."""
    mapping: dict[str, set[str]] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        url, sep, cards = entry.rpartition("=")
        if not sep or not url or not cards:
            raise ValueError(f"spillover_cards entry {entry!r} is not URL=card[+card...]")
        mapping[url.rstrip("/")] = {c.strip() for c in cards.split("+") if c.strip()}
    return mapping


def listening_pids(port: int, proc: Path = Path("/proc")) -> set[int]:
    """Processes with a TCP socket listening on `port`."""
    inodes = set()
    for table in ("net/tcp", "net/tcp6"):
        try:
            lines = (proc / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    pids = set()
    for pid in (p for p in proc.iterdir() if p.name.isdigit()):
        try:
            fds = list((pid / "fd").iterdir())
        except OSError:
            continue  # gone, or not ours to read
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue  # closed meanwhile: one vanished descriptor must not hide the rest
            if target in inodes:
                pids.add(int(pid.name))
                break
    return pids


class CardMap:
    def __init__(
        self,
        explicit: dict[str, set[str]],
        gpu_pids: Callable[[], dict[int, set[str]]],
        proc: Path = Path("/proc"),
    ) -> None:
        """`gpu_pids` gives pid -> GPU cards it holds (from NVML and fdinfo)."""
        self.explicit = explicit
        self._gpu_pids = gpu_pids
        self._proc = proc
        self._cache: dict[str, tuple[float, set[str]]] = {}

    def cards_of(self, server: str) -> set[str]:
        server = server.rstrip("/")
        if server in self.explicit:
            return self.explicit[server]
        cached = self._cache.get(server)
        if cached is not None and time.monotonic() - cached[0] < REFRESH_SECONDS:
            return cached[1]
        cards = self._discover(server)
        self._cache[server] = (time.monotonic(), cards)
        return cards

    def _discover(self, server: str) -> set[str]:
        parts = urlsplit(server)
        if parts.hostname not in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
            return set()  # not on this machine: only an explicit mapping can tell
        pids = listening_pids(parts.port or 80, self._proc)
        if not pids:
            return set()
        held = self._gpu_pids()
        cards = set().union(*(held.get(pid, set()) for pid in pids))
        return cards or {RAM}

    def servers_on(self, card: str, servers: Iterable[str]) -> set[str]:
        return {s for s in servers if card in self.cards_of(s)}
