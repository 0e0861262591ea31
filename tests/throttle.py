"""A server let run a little in every few milliseconds, as on a slow card: a tiny model
writes 400 tokens in about 0.3 s, and a client on a loaded machine may read its 3rd or
5th chunk later than that, when the proxy has the whole answer and a handoff or a kill
asked there has nothing left to move. Throttled, the same answer takes seconds.

The pacing (SIGCONT, a few ms, SIGSTOP) is a process of its own at a real-time priority:
paced by a thread of the test, a loaded machine that kept the thread waiting left the
server running free (the whole answer written in 0.56 s, in the suite), so the throttle
failed exactly where it was needed."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

PACER = r"""
import os, select, signal, sys, time
run_s, period_s = float(sys.argv[1]), float(sys.argv[2])
pids = [int(pid) for pid in sys.argv[3:]]
try:
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
except OSError:
    pass  # (no CAP_SYS_NICE) at the normal priority: a loaded machine may stop it late

def send(signum):
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # (one the test killed)
            pass

send(signal.SIGSTOP)
print("ready", flush=True)
held = False
while True:
    if not held:
        send(signal.SIGCONT)
        time.sleep(run_s)
        send(signal.SIGSTOP)
    if select.select([sys.stdin], [], [], None if held else period_s - run_s)[0]:
        line = sys.stdin.readline()
        if not line:
            break
        held = line.strip() == "hold"
        print("ok", flush=True)
send(signal.SIGCONT)
"""


class Throttled:
    """Processes (a server, or vLLM's API server and engine) let run `run_s` in every
    `period_s`, from `with` to its end."""

    def __init__(self, *pids: int, run_s: float = 0.002, period_s: float = 0.02) -> None:
        self.argv = [sys.executable, "-c", PACER, str(run_s), str(period_s), *map(str, pids)]
        self.pacer: subprocess.Popen[str] | None = None

    def __enter__(self) -> Throttled:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.pacer = subprocess.Popen(
            self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self._said("ready")

    def stop(self) -> None:
        """The processes run free again (nothing to do if never started)."""
        if self.pacer is not None and self.pacer.stdin is not None:
            self.pacer.stdin.close()  # the pacer lets them run and ends
            self.pacer.wait(timeout=10)

    @contextmanager
    def held(self) -> Iterator[None]:
        """Stopped throughout (as test_splice's `held` holds a server)."""
        self._tell("hold")
        try:
            yield
        finally:
            self._tell("go")

    def _tell(self, command: str) -> None:
        assert self.pacer is not None and self.pacer.stdin is not None
        self.pacer.stdin.write(command + "\n")
        self.pacer.stdin.flush()
        self._said("ok")

    def _said(self, expected: str) -> None:
        assert self.pacer is not None and self.pacer.stdout is not None
        said = self.pacer.stdout.readline().strip()
        assert said == expected, f"the pacer said {said!r} (exit {self.pacer.poll()})"
