"""Make real memory pressure on this machine, so a person can watch a handoff happen.

    .venv/bin/python -m scripts.stress ram --step-mib 512 --steps 4 --hold-s 30
    .venv/bin/python -m scripts.stress gpu --card nvml:0 --step-mib 4096 --steps 2 --hold-s 30

`ram` takes anonymous memory in steps (every page written, so it is really taken) and
says how much the kernel reports available after each; `gpu` takes device memory on an
NVIDIA card through the CUDA driver (libcuda, through ctypes: no torch or cupy needed),
named as `spillover_cards` names it (`nvml:N`) or by CUDA's number (`cuda:N`); with a
settings file (`--config`, or ./spillover.yaml) and no `--card`, the primary's card.
A step the card has not the room for is sized to what it has free, less `--leave-mib`,
saying so; where that leaves nothing to take, it says why in one line and exits with 1.
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
from pathlib import Path

from scripts.parts.cardorder import cuda_index
from scripts.parts.config import Config, with_config
from watchers.gates import parse_card_map
from watchers.meminfo import MeminfoSource
from watchers.reading import Reading
from watchers.sources import ALL, card_map, open_sources

MIB = 1024 * 1024
PAGE = mmap.PAGESIZE
OUT_OF_MEMORY = "CUDA_ERROR_OUT_OF_MEMORY"


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

    def free_mib(self) -> None:
        """Not asked: steps in RAM are taken as given (the kernel, not this, decides)."""

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
            said = (name.value or b"?").decode()
            full = ": the card has not that much free" if said == OUT_OF_MEMORY else ""
            raise RuntimeError(f"{call} failed: {said} ({result}){full}")

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

    def memory(self) -> tuple[int, int] | None:
        """The card's free and total bytes, as the driver says them now."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if self._cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) != 0:
            return None
        return free.value, total.value

    def free_mib(self) -> int | None:
        memory = self.memory()
        return None if memory is None else memory[0] // MIB

    def describe(self) -> str:
        if (memory := self.memory()) is None:
            return f"card {self.card}"
        return f"card {self.card}: {memory[0] / MIB:,.0f} of {memory[1] / MIB:,.0f} MiB free"

    def close(self) -> None:
        self.free()
        self._cuda.cuDevicePrimaryCtxRelease(self._device.value)


def sized(step_mib: int, free_mib: int | None, leave_mib: int) -> tuple[int, str]:
    """What a step takes, and what to say of it where that is not `step_mib`: at most
    what the card has free less `leave_mib` (nothing: no room)."""
    if free_mib is None or step_mib <= free_mib - leave_mib:
        return step_mib, ""
    room = max(free_mib - leave_mib, 0)
    if room == 0:
        return 0, (
            f"the card has {free_mib:,} MiB free and {leave_mib:,} are left free "
            "(--leave-mib): no room for a step"
        )
    return room, (
        f"{step_mib:,} MiB asked, the card has {free_mib:,} free: taking {room:,} "
        f"(--leave-mib {leave_mib:,} left free)"
    )


def run(
    hog: RamHog | CudaHog,
    step_mib: int,
    steps: int,
    every_s: float,
    hold_s: float,
    say: Callable[[str], None] = print,
    leave_mib: int = 0,
) -> int:
    """Takes the steps, holds them, gives them back; returns the MiB it took."""
    say(f"before: {hog.describe()}")
    taken = 0
    try:
        for step in range(1, steps + 1):
            if step > 1:
                time.sleep(every_s)
            mib, why = sized(step_mib, hog.free_mib(), leave_mib)
            if why:
                say(f"step {step}: {why}")
            if mib == 0:
                break
            try:
                hog.take(mib)
            except RuntimeError as exc:  # another process took the room meanwhile
                say(f"step {step}: {exc}")
                break
            taken += mib
            say(f"step {step}: took {mib:,} MiB ({taken:,} in all); {hog.describe()}")
        if taken:
            say(f"holding {taken:,} MiB for {hold_s:g} s")
            time.sleep(hold_s)
    except KeyboardInterrupt:
        say("interrupted")
    finally:
        hog.free()
        say(f"gave back {taken:,} MiB; {hog.describe()}")
    return taken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "where", choices=("ram", "gpu"),
        help="ram: this machine's memory; gpu: an NVIDIA card's, through the CUDA driver",
    )  # fmt: skip
    parser.add_argument(
        "--card",
        help="gpu: the card, as spillover_cards names it (nvml:N) or by CUDA's number (cuda:N) "
        "(default: the settings file's primary's, else nvml:0)",
    )  # fmt: skip
    parser.add_argument("--step-mib", type=int, default=1024, help="MiB taken per step")
    parser.add_argument("--steps", type=int, default=1, help="how many steps")
    parser.add_argument("--every-s", type=float, default=0.5, help="seconds between steps")
    parser.add_argument(
        "--hold-s", type=float, default=30.0, help="seconds the memory is held, then given back"
    )
    parser.add_argument(
        "--leave-mib", type=int, default=64,
        help="gpu: MiB a step leaves free where the card has not the room for it (default 64)",
    )  # fmt: skip
    args, config = with_config(parser, "stress", lambda _: {})
    try:
        if args.where == "ram":
            hog: RamHog | CudaHog = RamHog()
        else:
            hog = CudaHog(gpu(args.card or primary_card(config)))
    except (RuntimeError, ValueError) as exc:
        print(f"stress: {exc}", file=sys.stderr)
        sys.exit(2)
    try:
        taken = run(
            hog, args.step_mib, args.steps, args.every_s, args.hold_s,
            lambda said: print(said, flush=True), args.leave_mib,
        )  # fmt: skip
    finally:
        if isinstance(hog, CudaHog):
            hog.close()
    sys.exit(0 if taken or not args.steps else 1)


def primary_card(config: Config) -> str:
    """The NVIDIA card of the settings file's primary, saying which and how it is known
    (nvml:0 where the file names no primary); ValueError where it is on none here."""
    primary = config.get("primary")
    if primary is None:
        return "nvml:0"
    sources, _ = open_sources(ALL, Path("/sys"), Path("/proc"))
    explicit = parse_card_map(config.option("cards") or "")
    mapping = card_map(explicit, sources, Path("/proc"), Path("/sys")).mapping_of(primary)
    nvidia = sorted(card for card in mapping.cards if card.startswith("nvml:"))
    if not nvidia:
        on = ", ".join(sorted(mapping.cards)) or "none known"
        raise ValueError(
            f"the primary {primary} is on no NVIDIA card here ({on}: {mapping}): --card names one"
        )
    print(f"the primary {primary} is on {', '.join(nvidia)} ({mapping.how})", flush=True)
    return nvidia[0]


def gpu(card: str) -> int:
    """The CUDA index of the card named, saying which card that is."""
    index, said = cuda_index(card)
    print(f"card: {said}", flush=True)
    return index


if __name__ == "__main__":
    main()
