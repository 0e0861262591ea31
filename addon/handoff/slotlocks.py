"""Which restored slots are spoken for, shared by every proxy that migrates into a server.

A slot a migration restored is held until its continuation takes it. With one proxy a
set in memory says so; with several workers (`spillover run --workers`) two of them
could restore into the same idle slot, and the later restore would overwrite the
earlier one's state (costing the first continuation a full reading). So a reservation
is an exclusive `flock` on a small file in the slot directory every server and worker
shares: the kernel lets one open file hold it at a time, in this process or another,
and drops it when its holder exits, however it exits.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path

LOCKS = ".spillover-reserved"  # under the slot directory; the servers never read it


class SlotLocks:
    def __init__(self, directory: Path) -> None:
        self.directory = directory / LOCKS
        self._held: dict[tuple[str, int], int] = {}  # (server, slot) -> the open file

    def take(self, server: str, slot: int) -> bool:
        """Reserve `server`'s `slot`; False when some proxy holds it already."""
        if (server, slot) in self._held:
            return False
        self.directory.mkdir(exist_ok=True)
        descriptor = os.open(self._path(server, slot), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            return False
        self._held[(server, slot)] = descriptor
        return True

    def release(self, server: str, slot: int) -> None:
        descriptor = self._held.pop((server, slot), None)
        if descriptor is not None:
            os.close(descriptor)  # closing the only descriptor drops the lock

    def release_all(self) -> None:
        for server, slot in list(self._held):
            self.release(server, slot)

    def held(self) -> dict[str, list[int]]:
        by_server: dict[str, list[int]] = {}
        for server, slot in sorted(self._held):
            by_server.setdefault(server, []).append(slot)
        return by_server

    def _path(self, server: str, slot: int) -> Path:
        name = hashlib.sha256(server.encode()).hexdigest()[:16]
        return self.directory / f"{name}-{slot}.lock"
