"""Small kernel files read again and again: opened once, re-read with pread at offset 0
(sysfs and procfs regenerate the contents on every read from the start)."""

from __future__ import annotations

import os
from pathlib import Path


class KernelFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def read(self, size: int = 4096) -> bytes:
        return os.pread(self._fd, size, 0)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()
