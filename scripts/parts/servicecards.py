"""The servers' cards, for a service user that cannot find them itself.

The proxy finds a server's cards from its port: the process holding the port's socket,
found by reading each process's /proc/<pid>/fd. A user may not read another user's, so
a proxy run as a user of its own maps nothing and never hands off for memory, however
full a card gets. `install --system` runs as root: it maps the servers with the proxy's
own functions, and where their processes are not the service user's, the cards found
go into the settings file as `spillover_cards` (or, where some cannot be found now, the
line to add is said).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from scripts.parts.access import User
from watchers.gates import LOCAL_HOSTS, Mapping
from watchers.reading import Source
from watchers.sources import ALL, card_map, open_sources


@dataclass
class ServerCards:
    """What was found for the servers the service user cannot map itself."""

    found: dict[str, Mapping] = field(default_factory=dict)  # URL -> its cards, and how
    unknown: dict[str, str] = field(default_factory=dict)  # URL -> why its cards are not known
    ids: list[str] = field(default_factory=list)  # every card id this machine's sources report

    def value(self) -> str:
        """spillover_cards' value: found cards, CARD where one must be named."""
        entries = {url: "+".join(sorted(m.cards)) for url, m in self.found.items()}
        entries |= dict.fromkeys(self.unknown, "CARD")
        return ",".join(f"{url}={cards}" for url, cards in entries.items())

    def line(self) -> str:
        return f"spillover_cards: {json.dumps(self.value())}"


def cards_found(service_user: User | None, servers: list[str], settings: Path) -> str:
    """The spillover_cards value for a service user that cannot find the servers' cards
    itself ('' where none is needed, or where some are not known now: then it says the
    whole line to add)."""
    if service_user is None:
        return ""
    found = servers_cards(service_user, servers)
    name = service_user.name
    if found.unknown:
        why = "; ".join(f"{url}: {how}" for url, how in found.unknown.items())
        print(
            f"services: the servers' cards are not known now ({why}); unless their "
            f"processes will be {name}'s, add this line to {settings}: {found.line()} "
            f"(CARD: one of {', '.join(found.ids) or 'the ids spillover doctor shows'})"
        )
        return ""
    if not found.found:
        return ""
    how = "; ".join(f"{url}: {mapping}" for url, mapping in found.found.items())
    print(
        f"services: the servers' processes are not {name}'s: it may not read their "
        f"/proc/<pid>/fd to find their cards (found here: {how})"
    )
    return found.value()


def servers_cards(
    user: User, servers: list[str], proc: Path = Path("/proc"), sysfs: Path = Path("/sys")
) -> ServerCards:
    """The local servers' cards, where their processes are not `user`'s (or not known)."""
    sources, _ = open_sources(ALL, sysfs, proc)
    said = ServerCards(ids=card_ids(sources))
    cards = card_map({}, sources, proc, sysfs)
    for url in servers:
        if urlsplit(url).hostname not in LOCAL_HOSTS:
            continue  # another host's: mapped by the fleet's Prometheus, or by hand
        mapping = cards.mapping_of(url)
        if not mapping.cards:
            said.unknown[url] = str(mapping)
        elif owners(mapping.pids, proc) != {user.uid}:
            said.found[url] = mapping
    return said


def card_ids(sources: list[Source]) -> list[str]:
    """The cards the sources report (read once: the DRM fdinfo source learns which
    processes hold each card as it reads)."""
    ids: set[str] = set()
    for source in sources:
        try:
            ids.update(result.card for result in source.read())
        except OSError:
            continue
    return sorted(ids)


def owners(pids: tuple[int, ...], proc: Path) -> set[int | None]:
    found: set[int | None] = set()
    for pid in pids:
        try:
            found.add((proc / str(pid)).stat().st_uid)
        except OSError:
            continue  # exited meanwhile
    return found
