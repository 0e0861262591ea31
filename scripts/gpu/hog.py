"""Another process taking memory, for the GPU proof and its CPU rehearsal: a helper that
allocates or frees on request, and its client.

    CUDA_VISIBLE_DEVICES=GPU-UUID python -m scripts.gpu.hog cuda NVML_INDEX
                        # torch on that one card (its CUDA context made once, never timed)
    python -m scripts.gpu.hog file /sys/.../mem_info_vram_used
                        # a sysfs-tree card (scripts/testbed/memfiles.py) standing in for it

JSON lines in and out. Requests: {"op": "read"} (the card's used and total MiB),
{"op": "alloc", "what": "ballast"|"step", "mib": N} and {"op": "free", "what": ...}.
An allocation answers time.monotonic() just before it ("t0") and just after it is done
("t1"), and for a step the first time the card's own counter showed it ("nvml_seen",
polled for up to 200 ms). Freeing drops every block of that kind and gives the memory
back to the card (torch.cuda.empty_cache).

Both kinds of memory behave as torch's caching allocator does: a block counts on the
card while anything holds it, and even after that until the cache is emptied. So the
helper's loop is proven on the CPU the way it runs on the card: a block kept alive by a
stray reference is never given back, on the file card as on the GPU.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from scripts.parts.processes import die_with_parent

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20


class Hog:
    """The helper process, seen from the proof."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.log = log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "scripts.gpu.hog", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            cwd=REPO,
            env={**os.environ, **(env or {})},
            preexec_fn=die_with_parent,
        )
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    @classmethod
    def cuda(cls, nvml_index: int, uuid: str, log_path: Path) -> Hog:
        return cls(["cuda", str(nvml_index)], log_path, {"CUDA_VISIBLE_DEVICES": uuid})

    @classmethod
    def file_card(cls, used_file: Path, log_path: Path) -> Hog:
        return cls(["file", str(used_file)], log_path)

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
            raise RuntimeError(f"the memory helper did not answer in {timeout:.0f}s") from None
        if "error" in answer:
            raise RuntimeError(f"the memory helper failed: {answer['error']}")
        return answer

    def ask(self, timeout: float = 60, **request: Any) -> dict[str, Any]:
        self.send(**request)
        return self.reply(timeout)

    def read(self) -> tuple[float, float]:
        """The card's (used, total) MiB as the helper reads it."""
        answer = self.ask(op="read")
        return answer["used_mib"], answer["total_mib"]

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.send(op="quit")
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self.log.close()


# --- the helper's side ----------------------------------------------------------------


class Memory(Protocol):
    name: str

    def take(self, mib: int) -> Any:
        """A block of `mib` MiB, allocated and ready when this returns."""

    def give_back(self) -> None:
        """Return every block nothing holds any more to the card (empty_cache)."""

    def used_total(self) -> tuple[int, int] | None:
        """The card's own (used, total) bytes, or None where it cannot be read."""


class CudaMemory:
    def __init__(self, nvml_index: int) -> None:
        import torch

        self.torch = torch
        self.device = torch.device("cuda:0")  # the one card CUDA_VISIBLE_DEVICES shows
        torch.empty(1, device=self.device)
        torch.cuda.synchronize(self.device)
        self.name = torch.cuda.get_device_name(self.device)
        self._nvml = _nvml_reader(nvml_index)

    def take(self, mib: int) -> Any:
        block = self.torch.empty(mib * MIB, dtype=self.torch.uint8, device=self.device)
        self.torch.cuda.synchronize(self.device)
        return block

    def give_back(self) -> None:
        self.torch.cuda.empty_cache()
        self.torch.cuda.synchronize(self.device)

    def used_total(self) -> tuple[int, int] | None:
        return None if self._nvml is None else self._nvml()


class FileCardMemory:
    """A sysfs-tree card's `mem_info_vram_used` (and the `mem_info_vram_total` beside it):
    each live or cached block is written into it, as the driver would count it."""

    name = "a sysfs-tree card"

    def __init__(self, used_file: Path) -> None:
        from scripts.testbed.memfiles import write_in_place

        self._write = write_in_place
        self.used_file = used_file
        self.total = int((used_file.parent / "mem_info_vram_total").read_text())
        self.base = int(used_file.read_text())
        self.counted: dict[int, int] = {}  # block id -> bytes still on the card
        self.dead: set[int] = set()  # blocks nothing holds, still cached
        self._next = 0

    def take(self, mib: int) -> Any:
        block = _Block(self._next)
        self._next += 1
        self.counted[block.id] = mib * MIB
        weakref.finalize(block, self.dead.add, block.id)
        self._store()
        return block

    def give_back(self) -> None:
        for block_id in self.dead:
            self.counted.pop(block_id, None)
        self.dead.clear()
        self._store()

    def used_total(self) -> tuple[int, int] | None:
        return int(self.used_file.read_text()), self.total

    def _store(self) -> None:
        self._write(self.used_file, f"{self.base + sum(self.counted.values()):>20}\n")


class _Block:
    def __init__(self, block_id: int) -> None:
        self.id = block_id


def serve(memory: Memory, requests: Iterable[str], emit: Callable[..., None]) -> None:
    held: dict[str, list[Any]] = {"ballast": [], "step": []}
    emit(ready=True, name=memory.name)
    for line in requests:
        request = json.loads(line)
        op = request["op"]
        if op == "quit":
            return
        try:
            if op == "read":
                emit(op=op, **_read_mib(memory))
            elif op == "alloc":
                emit(op=op, **_allocate(memory, held[request["what"]], request))
            elif op == "free":
                held[request["what"]].clear()
                memory.give_back()
                emit(op=op, t1=time.monotonic())
            else:
                emit(error=f"unknown op {op!r}")
        except Exception as exc:  # out of memory, mostly: say so and stay up
            emit(error=repr(exc))


def _allocate(memory: Memory, into: list[Any], request: dict[str, Any]) -> dict[str, Any]:
    """One allocation, held only by `into`: a block left in a local of the serving loop
    would outlive its free (the proof's first GPU run kept its step that way)."""
    before = memory.used_total()
    t0 = time.monotonic()
    into.append(memory.take(request["mib"]))
    t1 = time.monotonic()
    seen = None
    if before is not None and request["what"] == "step":
        seen = _first_seen(memory, before[0] + 0.9 * request["mib"] * MIB, t1 + 0.2)
    return {"t0": t0, "t1": t1, "nvml_seen": seen}


def _read_mib(memory: Memory) -> dict[str, float | None]:
    found = memory.used_total()
    if found is None:
        return {"used_mib": None, "total_mib": None}
    return {"used_mib": found[0] / MIB, "total_mib": found[1] / MIB}


def _nvml_reader(index: int) -> Callable[[], tuple[int, int]] | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)

        def read() -> tuple[int, int]:
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            return info.used, info.total

        return read
    except Exception:
        return None


def _first_seen(memory: Memory, at_least: float, until: float) -> float | None:
    while (now := time.monotonic()) < until:
        found = memory.used_total()
        if found is not None and found[0] >= at_least:
            return now
    return None


def _emit(**reply: Any) -> None:
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> None:
    kind, where = argv
    memory: Memory = CudaMemory(int(where)) if kind == "cuda" else FileCardMemory(Path(where))
    serve(memory, sys.stdin, _emit)


if __name__ == "__main__":
    main(sys.argv[1:])
