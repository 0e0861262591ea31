"""Which CUDA index each NVML card has, for the doctor. `spillover_cards` names NVIDIA
cards as NVML numbers them (`nvml:N`, by PCI bus); CUDA, and so `CUDA_VISIBLE_DEVICES`,
`-dev`/`--device` and `spillover stress gpu --card`, numbers them fastest first unless
`CUDA_DEVICE_ORDER=PCI_BUS_ID`, and only those `CUDA_VISIBLE_DEVICES` shows. The two are
matched by PCI bus id: NVML's from nvidia-ml-py, CUDA's from its driver (libcuda, by
ctypes), in this environment's own order."""

from __future__ import annotations

import ctypes
import re
from collections.abc import Sequence
from typing import Any

from watchers.nvml import NvmlSource

BUS_ID = re.compile(r"^([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-7])$")


def normal(bus_id: str) -> tuple[int, int, int, int] | None:
    """A PCI bus id as NVML (`00000000:17:00.0`) or CUDA (`0000:17:00.0`) writes it."""
    found = BUS_ID.match(bus_id.strip())
    return tuple(int(part, 16) for part in found.groups()) if found else None  # type: ignore[return-value]


def cuda_indexes(nvml_ids: Sequence[str], cuda_ids: Sequence[str]) -> dict[int, int]:
    """{NVML index: CUDA index} of the cards both see."""
    cuda = {normal(bus): index for index, bus in enumerate(cuda_ids) if normal(bus)}
    return {i: cuda[normal(bus)] for i, bus in enumerate(nvml_ids) if normal(bus) in cuda}


def nvml_bus_ids(handles: Sequence[Any]) -> list[str]:
    import pynvml

    ids = []
    for handle in handles:
        bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
        ids.append(bus.decode() if isinstance(bus, bytes) else str(bus))
    return ids


def cuda_bus_ids() -> list[str] | str:
    """The PCI bus id of each card CUDA sees here, by CUDA index; or why not known."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"no CUDA driver here (libcuda.so.1: {exc})"
    count = ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return "the CUDA driver did not start (cuInit)"
    ids = []
    for index in range(count.value):
        device, text = ctypes.c_int(), ctypes.create_string_buffer(32)
        if cuda.cuDeviceGet(ctypes.byref(device), index) != 0:
            return f"CUDA device {index} cannot be opened"
        if cuda.cuDeviceGetPCIBusId(text, len(text), device) != 0:
            return f"CUDA device {index} has no PCI bus id"
        ids.append(text.value.decode())
    return ids


def lines(handles: Sequence[Any]) -> list[str]:
    """What the doctor says of the cards' numbers."""
    try:
        nvml = nvml_bus_ids(handles)
    except Exception as exc:  # an older driver or nvidia-ml-py: say so, do not fail
        return [f"their PCI bus ids cannot be read: {exc!r}"]
    cuda = cuda_bus_ids()
    if isinstance(cuda, str):
        return [
            f"nvml:{i} (PCI {bus}); CUDA's numbers not known: {cuda}" for i, bus in enumerate(nvml)
        ]
    found = cuda_indexes(nvml, cuda)
    said = []
    for index, bus in enumerate(nvml):
        if index not in found:
            said.append(
                f"nvml:{index} (PCI {bus}): not visible to CUDA here (CUDA_VISIBLE_DEVICES)"
            )
        elif found[index] != index:
            said.append(f"nvml:{index} (PCI {bus}) is CUDA {found[index]} here: the numbers differ")
        else:
            said.append(f"nvml:{index} (PCI {bus}) is CUDA {index} here too")
    return said


def cuda_index(card: str) -> tuple[int, str]:
    """The CUDA index of a card named as `spillover_cards` names it (`nvml:N`) or by
    CUDA's own number (`cuda:N`), and what to say of the translation; ValueError says
    why it cannot be found."""
    kind, _, number = card.partition(":")
    if kind not in ("nvml", "cuda") or not number.isdigit():
        raise ValueError(
            f"{card!r}: name an NVIDIA card as spillover_cards does (nvml:N; "
            "`spillover doctor` lists them) or by CUDA's number (cuda:N)"
        )
    index = int(number)
    cuda = cuda_bus_ids()
    if isinstance(cuda, str):
        raise ValueError(cuda)
    if kind == "cuda":
        if index >= len(cuda):
            raise ValueError(f"{card}: CUDA sees {len(cuda)} card(s) here")
        return index, f"{card} (PCI {cuda[index]})"
    try:
        nvml = nvml_bus_ids(NvmlSource().handles)
    except Exception as exc:  # no NVML (NotApplicable), or a driver that will not answer
        raise ValueError(f"{card}: NVML cannot number the cards here ({exc})") from None
    if index >= len(nvml):
        raise ValueError(f"{card}: NVML sees {len(nvml)} card(s) here")
    found = cuda_indexes(nvml, cuda)
    if index not in found:
        raise ValueError(f"{card} (PCI {nvml[index]}) is not visible to CUDA here")
    return found[index], f"{card} (PCI {nvml[index]}), CUDA {found[index]} here"
