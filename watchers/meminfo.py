"""System RAM from /proc/meminfo: the memory of CPU-only servers and of unified-memory GPUs."""

from __future__ import annotations

import time
from pathlib import Path

from watchers.files import KernelFile
from watchers.reading import CardFailure, NotApplicable, Reading

CARD = "ram"


class MeminfoSource:
    name = "meminfo"

    def __init__(self, path: Path = Path("/proc/meminfo")) -> None:
        self.path = path
        try:
            self._file = KernelFile(path)
        except OSError:
            raise NotApplicable(f"{path} cannot be read (not Linux?)") from None

    def read(self) -> list[Reading | CardFailure]:
        text = self._file.read(512)  # MemTotal, MemFree, MemAvailable lead the file
        total = _kib(text, b"MemTotal:") / 1024
        available = _kib(text, b"MemAvailable:") / 1024
        return [Reading(CARD, total - available, total, time.monotonic())]


def _kib(text: bytes, field: bytes) -> int:
    start = text.find(field)
    if start < 0:
        raise ValueError(f"no {field.decode()} in meminfo")
    return int(text[start + len(field) : text.index(b"kB", start)])
