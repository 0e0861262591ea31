"""Which cards a server uses, so only streams on a card under pressure are handed off.

Found automatically for servers on this machine: listening port -> process -> the cards
NVML's process lists or the DRM fdinfo counters show it on, else the GPU device files it
holds open (`watchers.devices`); a server with no GPU device open computes in system RAM.
An explicit mapping (`spillover_cards`) wins; a server on another host is mapped to the
cards the fleet's Prometheus shows there (`watchers.prometheus`), or by that mapping.
`CardMap.mapping_of` says which of these ways each server was mapped, and why not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

from watchers.devices import DeviceCards, open_devices
from watchers.listeners import (
    LOCAL_HOSTS,
    Listeners,
    ListenerScans,
    ListeningPids,
    descendants,
    port_of,
)
from watchers.listeners import listening_pids as listening_pids  # for older importers
from watchers.meminfo import CARD as RAM

REFRESH_SECONDS = 10.0
SOON_SECONDS = 1.0  # an unsettled mapping's next look
log = logging.getLogger(__name__)


def parse_card_map(text: str) -> dict[str, set[str]]:
    """ "URL=card+card,URL=card" -> {URL as given: {cards}}; raises ValueError on a malformed
    entry. The URLs are the servers' as a person spelled them: the addon and the doctor
    key the map by the servers they name (addon/servers/keyed.py) before it is used."""
    mapping: dict[str, set[str]] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        url, sep, cards = entry.rpartition("=")
        if not sep or not url or not cards:
            raise ValueError(
                f"spillover_cards entry {entry!r} is not URL=card[+card...] (e.g. "
                "http://127.0.0.1:8081=nvml:0+nvml:1,http://127.0.0.1:8082=ram; "
                "`spillover doctor` lists the cards here)"
            )
        url = url.strip().rstrip("/")
        if url in mapping:
            raise ValueError(f"spillover_cards: {url} is named twice: name it once")
        mapping[url] = {c.strip() for c in cards.split("+") if c.strip()}
    return mapping


# How a server was mapped (`Mapping.how`); two of the first four may be joined by " + ".
EXPLICIT = "explicit"  # spillover_cards
NVML_PROCESSES = "nvml processes"  # NVML's compute/graphics process lists name the pid
DRM_FDINFO = "drm fdinfo"  # the pid holds DRM memory in its fdinfo counters
PROCESS_LIST = "gpu process list"  # a pid -> cards list that does not say where it came from
DEVICE_FILES = "device files"  # /dev/nvidia<N>, /dev/dri/renderD<N> or card<N> held open
IN_RAM = "ram"  # a local process with no GPU device open
REMOTE = "not on this machine"
PROMETHEUS = "prometheus"  # a remote server's cards, from the fleet's Prometheus
NOT_LISTENING = "not listening"
PERMISSION = "permission"  # the process is there, but its descriptors are not ours to read
UNSEEN = "unseen"  # the port listens, but no process visible here holds it
FORWARDED = "forwarded"  # the port is held by a forwarder (docker-proxy, ssh -L...)

FORWARDERS = {"docker-proxy", "rootlessport", "slirp4netns", "pasta", "pasta.avx2", "ssh"}
SAY_IT = "say its cards with spillover_cards"
MANY_CARDS = (
    "a process holds the device files of every card it can see, used or not, so it may "
    "compute on fewer of these (CUDA_VISIBLE_DEVICES narrows what it sees; " + SAY_IT + ")"
)


@dataclass(frozen=True)
class Mapping:
    cards: frozenset[str]
    how: str  # one of the names above
    detail: str = ""  # for people: which processes, which device files, what to do
    pids: tuple[int, ...] = ()  # the server's processes (or those we could not read)
    # False when made before every source that lists GPU processes had read: it may name
    # the server's cards once they have, and is looked up again soon (SOON_SECONDS).
    settled: bool = True

    def __str__(self) -> str:
        return f"{self.how}: {self.detail}" if self.detail else self.how

    def status(self) -> dict:
        return {
            "cards": sorted(self.cards),
            "how": self.how,
            "detail": self.detail,
            "pids": list(self.pids),
            "settled": self.settled,
        }


class PidCards(dict[int, set[str]]):
    """pid -> GPU cards it holds, and `how[pid]`: which lists named it."""

    def __init__(self) -> None:
        super().__init__()
        self.how: dict[int, set[str]] = {}
        self.complete = True  # False while a source that lists pids has not read yet

    def add(self, pid: int, cards: Iterable[str], how: str) -> None:
        self.setdefault(pid, set()).update(cards)
        self.how.setdefault(pid, set()).add(how)


class CardMap:
    def __init__(
        self,
        explicit: dict[str, set[str]],
        gpu_pids: Callable[[], dict[int, set[str]]],
        proc: Path = Path("/proc"),
        *,
        sysfs: Path = Path("/sys"),
        minors: Callable[[], dict[int, str]] = dict,
        remote: Callable[[str], Mapping] | None = None,
    ) -> None:
        """`gpu_pids` gives pid -> GPU cards it holds (from NVML and fdinfo; a `PidCards`
        also says which); `minors` gives NVML's /dev/nvidia<N> minor -> card; `remote`
        maps a server on another host (from Prometheus), asked each time: cheap, and
        its cards appear as Prometheus answers."""
        self.explicit = explicit
        self.remote = remote
        self._gpu_pids = gpu_pids
        self._minors = minors
        self._proc = proc
        self._sys = sysfs
        self._cache: dict[str, tuple[float, Mapping]] = {}
        self._rediscovering: set[str] = set()
        self._lock = threading.Lock()
        self._scans = ListenerScans(proc)
        self._listening = ListeningPids(REFRESH_SECONDS, proc, self._scans)

    def mapping_of(self, server: str) -> Mapping:
        server = server.rstrip("/")
        if server in self.explicit:
            return Mapping(frozenset(self.explicit[server]), EXPLICIT, "spillover_cards")
        if self.remote is not None and urlsplit(server).hostname not in LOCAL_HOSTS:
            return self.remote(server)
        cached = self._cache.get(server)
        if cached is None:
            return self._rediscover(server)
        if time.monotonic() - cached[0] >= REFRESH_SECONDS:
            self._rediscover_later(server)
        return cached[1]

    def _rediscover(self, server: str) -> Mapping:
        mapping = self._discover(server)
        made = time.monotonic()
        self._cache[server] = (
            made if mapping.settled else made - REFRESH_SECONDS + SOON_SECONDS,
            mapping,
        )
        return mapping

    def _rediscover_later(self, server: str) -> None:
        """Look the server up again on a thread of its own; the mapping known is used
        meanwhile. A first lookup walks every process's descriptors (a GPU box has
        thousands): on the proxy's event loop, each refresh stopped every stream for that
        long (later ones read less: listeners.ListenerScans)."""
        with self._lock:
            if server in self._rediscovering:
                return
            self._rediscovering.add(server)

        def rediscover() -> None:
            try:
                self._rediscover(server)
            except Exception:  # the known mapping serves on, asked again in REFRESH_SECONDS
                log.exception("looking up the cards of %s again failed", server)
                if (known := self._cache.get(server)) is not None:
                    self._cache[server] = (time.monotonic(), known[1])
            finally:
                with self._lock:
                    self._rediscovering.discard(server)

        threading.Thread(target=rediscover, name="spillover-card-map", daemon=True).start()

    def cards_of(self, server: str) -> set[str]:
        return set(self.mapping_of(server).cards)

    def servers_on(self, card: str, servers: Iterable[str]) -> set[str]:
        return {s for s in servers if card in self.mapping_of(s).cards}

    def server_pids(self, servers: Iterable[str]) -> set[int]:
        """The processes of these servers on this machine: those listening on their ports
        (looked up again every REFRESH_SECONDS) and every process they started, looked up
        each time (a model loaded again may run in a new child, as with llama-swap)."""
        pids: set[int] = set()
        for server in servers:
            for pid in self._listening.of(server) or ():
                pids |= {pid, *descendants(pid, self._proc)}
        return pids

    def _discover(self, server: str) -> Mapping:
        parts = urlsplit(server)
        if parts.hostname not in LOCAL_HOSTS:
            return Mapping(frozenset(), REMOTE, f"{parts.hostname} is not this machine: {SAY_IT}")
        port = port_of(parts)
        found = self._scans.find(port)
        if not found.pids:
            return self._not_found(port, found)
        # With the processes they started: vLLM's EngineCore and Worker hold its card.
        started = [child for pid in found.pids for child in descendants(pid, self._proc)]
        pids = tuple(sorted({*found.pids, *started}))
        names = {pid: self._comm(pid) for pid in pids}
        who = ", ".join(f"pid {pid} ({name})" for pid, name in names.items())
        held = self._gpu_pids()
        listed = [pid for pid in pids if pid in held]
        if listed:
            labels = getattr(held, "how", {})
            how = " + ".join(sorted(set().union(*(labels.get(p, {PROCESS_LIST}) for p in listed))))
            cards = frozenset().union(*(held[pid] for pid in listed))
            return Mapping(cards, how, f"{who} on {', '.join(sorted(cards))}", pids)
        if all(name in FORWARDERS for name in names.values()):
            return Mapping(
                frozenset(), FORWARDED,
                f"port {port} is held by {who}, a forwarder: the server behind it cannot be "
                f"followed from here; {SAY_IT}",
                pids,
            )  # fmt: skip
        mapping = self._by_devices(pids, who)
        return mapping if getattr(held, "complete", True) else replace(mapping, settled=False)

    def _by_devices(self, pids: tuple[int, ...], who: str) -> Mapping:
        cards: set[str] = set()
        notes: list[str] = []
        resolver: DeviceCards | None = None
        alive = 0
        for pid in pids:
            try:
                devices = open_devices(pid, self._proc)
            except PermissionError:
                return Mapping(frozenset(), PERMISSION, self._cannot_read([pid]), pids)
            except OSError:
                continue  # exited meanwhile
            alive += 1
            for device in devices:
                resolver = resolver or DeviceCards(self._minors(), self._sys)
                if (found := resolver.identify(device)) is not None:
                    notes.append(found.note)
                    if found.card is not None:
                        cards.add(found.card)
        if not alive:
            return Mapping(frozenset(), NOT_LISTENING, f"{who} exited", pids)
        if not notes:
            return Mapping(frozenset({RAM}), IN_RAM, f"no GPU device open by {who}", pids)
        if len(cards) > 1:
            notes.append(MANY_CARDS)
        return Mapping(frozenset(cards), DEVICE_FILES, f"{who}: {'; '.join(notes)}", pids)

    def _not_found(self, port: int, found: Listeners) -> Mapping:
        if found.unreadable:
            pids = tuple(sorted(found.unreadable))
            return Mapping(
                frozenset(), PERMISSION, f"port {port} listens, but {self._cannot_read(pids)}", pids
            )
        if found.listening:
            return Mapping(
                frozenset(), UNSEEN,
                f"port {port} listens, but no process visible here holds it (another PID "
                f"namespace?): {SAY_IT}",
            )  # fmt: skip
        return Mapping(
            frozenset(), NOT_LISTENING,
            f"no process listening on port {port} in this network namespace (a server in a "
            f"container behind a published port cannot be followed: {SAY_IT})",
        )  # fmt: skip

    def _cannot_read(self, pids: Iterable[int]) -> str:
        pids = list(pids)
        shown = ", ".join(f"{self._proc}/{pid}/fd" for pid in pids[:4])
        more = f" and {len(pids) - 4} more" if len(pids) > 4 else ""
        return (
            f"cannot read {shown}{more} (permission denied: another user's process); run the "
            f"proxy as that user, as root or with CAP_SYS_PTRACE, or {SAY_IT}"
        )

    def _comm(self, pid: int) -> str:
        try:
            return (self._proc / str(pid) / "comm").read_text().strip()
        except OSError:
            return "?"
