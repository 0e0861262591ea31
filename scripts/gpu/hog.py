"""Another process taking GPU memory, for the GPU proof: a helper that holds torch's CUDA
context (so creating it is never timed) and allocates or frees on request, and the plan
of what to allocate.

    CUDA_VISIBLE_DEVICES=GPU-UUID python -m scripts.gpu.hog NVML_INDEX
                                # the helper, on that one card; JSON lines in and out

Requests: {"op": "alloc", "what": "ballast"|"step", "mib": N} and {"op": "free",
"what": ...}; each answer carries time.monotonic() just before torch.empty ("t0") and
just after it and torch.cuda.synchronize() returned ("t1"), and for a step the first time
NVML showed the memory taken ("nvml_seen", polled for up to 200 ms).

The plan: the ballast is taken in chunks, each small enough (and far enough apart) that
no pressure line fires, until about `target_free` MiB is left; the step then leaves about
`after_free`. Each chunk is checked against the project's own pressure logic
(watchers.pressure, default lines) before it is taken.
"""

from __future__ import annotations

import copy
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts.parts.processes import die_with_parent

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20


@dataclass
class Plan:
    ballast_mib: list[int]  # chunks, in order
    gap_s: float  # between two chunks (longer than the step line's window)
    target_free_mib: float
    step_mib: int
    checked: str  # how the plan was checked against the lines
    step_fires: bool | None = None  # whether the step crosses a line (None: not known)
    notes: list[str] = field(default_factory=list)


class Simulator:
    """A card's pressure state, fed the readings the monitor would take."""

    def allocate(self, free_after: float, duration_s: float) -> bool:
        """Memory drops to `free_after` now, then `duration_s` passes: whether it fired."""
        raise NotImplementedError

    def clear_at(self, free: float) -> bool:
        """Whether a card with this much free is clear of every line (re-armed)."""
        raise NotImplementedError


class PressureSimulator(Simulator):
    """The project's own pressure logic (watchers.pressure) with its default lines, read
    every 5 ms (denser than the monitor ever reads, so it fires at least as readily)."""

    def __init__(self, total_mib: float, free_mib: float) -> None:
        from watchers.pressure import CardState, Lines
        from watchers.reading import Reading

        self._reading, self.lines = Reading, Lines()
        self.state = CardState("plan")
        self.total, self.free, self.now = total_mib, free_mib, 0.0
        self._idle(1.0)

    def _idle(self, duration_s: float) -> bool:
        fired = False
        end = self.now + duration_s
        while self.now < end:
            reading = self._reading("plan", self.total - self.free, self.total, self.now)
            fired |= bool(self.state.observe(reading, self.lines))
            self.now += 0.005
        return fired

    def allocate(self, free_after: float, duration_s: float) -> bool:
        self.free = free_after
        return self._idle(duration_s)

    def clear_at(self, free: float) -> bool:
        reading = self._reading("plan", self.total - free, self.total, self.now)
        return bool(type(self.state)("plan").clear(reading, self.lines))


def plan_memory(
    total_mib: float,
    used_mib: float,
    *,
    target_free_mib: float = 6144,
    after_free_mib: float = 1024,
    gap_s: float = 0.5,
    simulator: Callable[[float, float], Simulator] | None = PressureSimulator,
    min_chunk_mib: int = 128,
) -> Plan:
    """What to take: ballast chunks down to `target_free_mib`, then one step leaving
    `after_free_mib` free. Without a simulator the chunks stay under a third of what is
    free above 2 GiB (no step line of today's kind fires on them)."""
    free = total_mib - used_mib
    notes: list[str] = []
    sim: Simulator | None = None
    if simulator is not None:
        try:
            sim = simulator(total_mib, free)
            while not sim.clear_at(target_free_mib) and target_free_mib < free:
                target_free_mib += 1024  # after the step is freed, the card must re-arm
        except Exception as exc:  # the pressure module changed shape: plan without it
            notes.append(f"pressure logic not usable for the plan ({exc!r})")
            sim = None
    chunks: list[int] = []
    while free - target_free_mib >= 1:
        size = int(free - target_free_mib)
        if sim is None:
            size = min(size, max(min_chunk_mib, int((free - 2048) / 3) - 64))
        else:
            while size > min_chunk_mib and copy.deepcopy(sim).allocate(free - size, gap_s):
                size //= 2
            if sim.allocate(free - size, gap_s):
                notes.append(f"a chunk of {size} MiB crosses a line even so")
        chunks.append(size)
        free -= size
    step = int(free - after_free_mib)
    step_fires = None if sim is None else sim.allocate(free - step, 0.05)
    checked = "watchers.pressure, default lines" if sim is not None else "not checked"
    return Plan(chunks, gap_s, target_free_mib, step, checked, step_fires, notes)


class Hog:
    """The helper process, seen from the proof."""

    def __init__(self, nvml_index: int, uuid: str, log_path: Path) -> None:
        self.log = log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "scripts.gpu.hog", str(nvml_index)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            cwd=REPO,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": uuid},
            preexec_fn=die_with_parent,
        )
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                self._replies.put(json.loads(line))
            except ValueError:
                continue
        self._replies.put({"error": f"helper exited with {self.process.wait()}"})

    def send(self, **request: Any) -> None:
        """Ask without waiting (the stream reader calls this mid-answer)."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        self.process.stdin.flush()

    def reply(self, timeout: float = 60) -> dict[str, Any]:
        try:
            answer = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"the GPU memory helper did not answer in {timeout:.0f}s") from None
        if "error" in answer:
            raise RuntimeError(f"the GPU memory helper failed: {answer['error']}")
        return answer

    def ask(self, timeout: float = 60, **request: Any) -> dict[str, Any]:
        self.send(**request)
        return self.reply(timeout)

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.send(op="quit")
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self.log.close()


def _serve(index: int) -> None:
    import torch

    device = torch.device("cuda:0")  # the one card CUDA_VISIBLE_DEVICES shows
    torch.empty(1, device=device)
    torch.cuda.synchronize(device)
    nvml_used = _nvml_used(index)
    held: dict[str, list[Any]] = {"ballast": [], "step": []}
    _emit(ready=True, name=torch.cuda.get_device_name(device))
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        if op == "quit":
            return
        try:
            if op == "alloc":
                before = nvml_used() if nvml_used else None
                t0 = time.monotonic()
                block = torch.empty(request["mib"] * MIB, dtype=torch.uint8, device=device)
                torch.cuda.synchronize(device)
                t1 = time.monotonic()
                held[request["what"]].append(block)
                seen = None
                if nvml_used is not None and before is not None and request["what"] == "step":
                    seen = _first_seen(nvml_used, before + 0.9 * request["mib"] * MIB, t1 + 0.2)
                _emit(op=op, t0=t0, t1=t1, nvml_seen=seen)
            elif op == "free":
                held[request["what"]].clear()
                torch.cuda.empty_cache()
                torch.cuda.synchronize(device)
                _emit(op=op, t1=time.monotonic())
            else:
                _emit(error=f"unknown op {op!r}")
        except Exception as exc:  # out of memory, mostly: say so and stay up
            _emit(error=repr(exc))


def _nvml_used(index: int) -> Callable[[], int] | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used
    except Exception:
        return None


def _first_seen(used: Callable[[], int], at_least: float, until: float) -> float | None:
    while (now := time.monotonic()) < until:
        if used() >= at_least:
            return now
    return None


def _emit(**reply: Any) -> None:
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
