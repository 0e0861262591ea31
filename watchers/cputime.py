"""Whether a server on this machine is working: the CPU time of the processes that hold
its port, from /proc/PID/stat. A server whose /health goes unanswered while those
processes keep a core busy is loaded (vLLM answers /health on the event loop that its
requests keep busy); one whose processes use no CPU is stopped or stuck waiting."""

from __future__ import annotations

import os
import time
from pathlib import Path

from watchers.listeners import LIVE_PROC, ListeningPids

TICK_S = 1 / os.sysconf("SC_CLK_TCK")  # /proc/PID/stat counts CPU time in these
# Of one core, over the window: a server that waits (a stopped one, a deadlock, timers
# alone) uses next to nothing; a busy one's event loop uses most of a core.
WORKING_SHARE = 0.1
PIDS_FOR_S = 30.0  # who holds a port is looked up again after this


class ServerProcesses:
    def __init__(self, proc: Path = LIVE_PROC) -> None:
        self._proc = proc
        self._listening = ListeningPids(PIDS_FOR_S, proc)

    def working(self, url: str, window_s: float) -> bool | None:
        """Whether the processes listening on `url`'s port used at least WORKING_SHARE of
        a core over the next `window_s` (it sleeps that long: call it off the event
        loop); None where that cannot be told: another machine's server, or no process
        that holds the port is ours to read."""
        if (pids := self._listening.of(url)) is None:
            return None
        if (before := cpu_seconds(pids, self._proc)) is None:
            self._listening.forget(url)  # gone: looked up again next time
            return None
        time.sleep(window_s)
        if (after := cpu_seconds(pids, self._proc)) is None:
            return None
        return after - before >= WORKING_SHARE * window_s


def cpu_seconds(pids: frozenset[int], proc: Path = LIVE_PROC) -> float | None:
    """The CPU time (user and system, every thread) these processes have used; None when
    none of them is there."""
    total, found = 0, False
    for pid in pids:
        try:
            stat = (proc / str(pid) / "stat").read_bytes()
        except OSError:
            continue  # ended
        # After the command's name, which may hold spaces and parentheses: fields 3 on,
        # utime and stime are the 14th and 15th.
        fields = stat[stat.rindex(b")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])
        found = True
    return total * TICK_S if found else None
