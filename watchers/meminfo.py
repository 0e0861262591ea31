"""System RAM from /proc/meminfo: the memory of CPU-only servers and of unified-memory GPUs."""

from __future__ import annotations

import time
from pathlib import Path

from watchers.reading import CardFailure, NotApplicable, Reading

CARD = "ram"


class MeminfoSource:
    name = "meminfo"

    def __init__(self, path: Path = Path("/proc/meminfo")) -> None:
        self.path = path
        if not path.exists():
            raise NotApplicable(f"{path} does not exist (not Linux?)")

    def read(self) -> list[Reading | CardFailure]:
        fields: dict[str, int] = {}
        for line in self.path.read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in ("MemTotal", "MemAvailable"):
                fields[name] = int(rest.split()[0])  # kB
        if len(fields) != 2:
            raise OSError(f"{self.path} lacks MemTotal or MemAvailable")
        total = fields["MemTotal"] / 1024
        return [Reading(CARD, total - fields["MemAvailable"] / 1024, total, time.monotonic())]
