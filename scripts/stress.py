"""Make real memory pressure on this machine, so a person can watch a handoff happen.

    .venv/bin/python -m scripts.stress ram --step-mib 512 --steps 4 --hold-s 30
    .venv/bin/python -m scripts.stress gpu --card nvml:0 --step-mib 4096 --steps 2 --hold-s 30

`ram` takes anonymous memory in steps (every page written, so it is really taken) and
says how much the kernel reports available after each; `gpu` takes device memory on an
NVIDIA card through the CUDA driver (libcuda, through ctypes: no torch or cupy needed),
named as `spillover_cards` names it (`nvml:N`) or by CUDA's number (`cuda:N`).
Each step waits `--every-s`; the memory is held for `--hold-s`, then given back (also on
Ctrl-C), and the command says what it did and what is free again.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import sys
import time
from collections.abc import Callable

from scripts.parts.cardorder import cuda_index
from watchers.meminfo import MeminfoSource
from watchers.reading import Reading

MIB = 1024 * 1024
PAGE = mmap.PAGESIZE


class RamHog:
    """Anonymous memory, every page written so that the kernel really hands it out."""

    def __init__(self) -> None:
        self._maps: list[mmap.mmap] = []

    def take(self, mib: int) -> None:
        block = mmap.mmap(-1, mib * MIB)
        for offset in range(0, mib * MIB, PAGE):
            block[offset] = 1
        self._maps.append(block)

    def free(self) -> None:
        for block in self._maps:
            block.close()
        self._maps.clear()

    def describe(self) -> str:
        (reading,) = MeminfoSource().read()
        assert isinstance(reading, Reading) and reading.total_mib is not None
        return f"ram: {reading.total_mib - reading.used_mib:,.0f} MiB available"


P = ctypes.POINTER
SIGNATURES = {  # sizes are 64-bit: ctypes would pass a bare int as a 32-bit one
    "cuInit": [ctypes.c_uint],
    "cuDeviceGet": [P(ctypes.c_int), ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [P(ctypes.c_void_p), ctypes.c_int],
    "cuDevicePrimaryCtxRelease": [ctypes.c_int],
    "cuCtxSetCurrent": [ctypes.c_void_p],
    "cuCtxSynchronize": [],
    "cuMemAlloc_v2": [P(ctypes.c_uint64), ctypes.c_size_t],
    "cuMemsetD8_v2": [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t],
    "cuMemFree_v2": [ctypes.c_uint64],
    "cuMemGetInfo_v2": [P(ctypes.c_size_t), P(ctypes.c_size_t)],
    "cuGetErrorName": [ctypes.c_int, P(ctypes.c_char_p)],
}


class CudaHog:
    """Device memory on one NVIDIA card, through the CUDA driver API."""

    def __init__(self, card: int) -> None:
        try:
            self._cuda = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise RuntimeError(f"no CUDA driver here (libcuda.so.1: {exc})") from exc
        for name, argtypes in SIGNATURES.items():
            getattr(self._cuda, name).argtypes = argtypes
        self._check(self._cuda.cuInit(0), "cuInit")
        device = ctypes.c_int()
        self._check(self._cuda.cuDeviceGet(ctypes.byref(device), card), f"cuDeviceGet({card})")
        self._device = device
        self._context = ctypes.c_void_p()
        retain = self._cuda.cuDevicePrimaryCtxRetain
        self._check(retain(ctypes.byref(self._context), device.value), "cuDevicePrimaryCtxRetain")
        self._check(self._cuda.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
        self._blocks: list[ctypes.c_uint64] = []
        self.card = card

    def _check(self, result: int, call: str) -> None:
        if result != 0:
            name = ctypes.c_char_p()
            self._cuda.cuGetErrorName(result, ctypes.byref(name))
            raise RuntimeError(f"{call} failed: {(name.value or b'?').decode()} ({result})")

    def take(self, mib: int) -> None:
        pointer = ctypes.c_uint64()
        self._check(self._cuda.cuMemAlloc_v2(ctypes.byref(pointer), mib * MIB), "cuMemAlloc")
        self._blocks.append(pointer)
        # Written, as a model's weights are: the memory is in use, not just reserved.
        self._check(self._cuda.cuMemsetD8_v2(pointer.value, 1, mib * MIB), "cuMemsetD8")
        self._check(self._cuda.cuCtxSynchronize(), "cuCtxSynchronize")

    def free(self) -> None:
        for pointer in self._blocks:
            self._cuda.cuMemFree_v2(pointer.value)
        self._blocks.clear()

    def describe(self) -> str:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if self._cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) != 0:
            return f"card {self.card}"
        return f"card {self.card}: {free.value / MIB:,.0f} of {total.value / MIB:,.0f} MiB free"

    def close(self) -> None:
        self.free()
        self._cuda.cuDevicePrimaryCtxRelease(self._device.value)


def run(
    hog: RamHog | CudaHog,
    step_mib: int,
    steps: int,
    every_s: float,
    hold_s: float,
    say: Callable[[str], None] = print,
) -> None:
    say(f"before: {hog.describe()}")
    taken = 0
    try:
        for step in range(1, steps + 1):
            if step > 1:
                time.sleep(every_s)
            hog.take(step_mib)
            taken += step_mib
            say(f"step {step}: took {step_mib:,} MiB ({taken:,} in all); {hog.describe()}")
        say(f"holding {taken:,} MiB for {hold_s:g} s")
        time.sleep(hold_s)
    except KeyboardInterrupt:
        say("interrupted")
    finally:
        hog.free()
        say(f"gave back {taken:,} MiB; {hog.describe()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "where", choices=("ram", "gpu"),
        help="ram: this machine's memory; gpu: an NVIDIA card's, through the CUDA driver",
    )  # fmt: skip
    parser.add_argument(
        "--card", default="nvml:0",
        help="gpu: the card, as spillover_cards names it (nvml:N) or by CUDA's number (cuda:N)",
    )  # fmt: skip
    parser.add_argument("--step-mib", type=int, default=1024, help="MiB taken per step")
    parser.add_argument("--steps", type=int, default=1, help="how many steps")
    parser.add_argument("--every-s", type=float, default=0.5, help="seconds between steps")
    parser.add_argument(
        "--hold-s", type=float, default=30.0, help="seconds the memory is held, then given back"
    )
    args = parser.parse_args()
    try:
        hog: RamHog | CudaHog = RamHog() if args.where == "ram" else CudaHog(gpu(args.card))
    except (RuntimeError, ValueError) as exc:
        print(f"stress: {exc}", file=sys.stderr)
        sys.exit(2)
    try:
        run(
            hog,
            args.step_mib,
            args.steps,
            args.every_s,
            args.hold_s,
            lambda s: print(s, flush=True),
        )
    finally:
        if isinstance(hog, CudaHog):
            hog.close()


def gpu(card: str) -> int:
    """The CUDA index of the card named, saying which card that is."""
    index, said = cuda_index(card)
    print(f"card: {said}", flush=True)
    return index


if __name__ == "__main__":
    main()
