"""Handoffs not made because no server could go on with the answer (answer/decide.py),
for /spillover/status: counted by kind, the last few with why."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

RECENT = 20  # declined handoffs kept for the status


class Declines:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._recent: deque[dict[str, Any]] = deque(maxlen=RECENT)

    def note(self, kind: str, answer: str, server: str, why: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        at = round(time.time(), 3)
        self._recent.append({"at": at, "flow": answer, "kind": kind, "server": server, "why": why})

    def status(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "recent": list(self._recent)}
