"""NvmlSource's own logic on a stand-in for nvidia-ml-py: there is no NVIDIA driver on
the machines the suite runs on, and what is tested here is the source's handling of
what the driver says (the v2 reserve, drivers without v2, minor numbers, re-initialising
after hotplug), not the driver. The real library is tested at its boundary in
test_watchers.py, and the whole source ran on a real H200 (the project's notes)."""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest

from watchers.nvml import NvmlSource
from watchers.reading import MIB, Reading


class NVMLError(Exception):
    pass


class NVMLError_FunctionNotFound(NVMLError):
    pass


@dataclass
class Card:
    uuid: str
    minor: int
    total: int
    used: int
    reserved: int = 0
    v2: bool = True


def fake_nvml(cards: list[Card]) -> types.SimpleNamespace:
    """The calls NvmlSource makes, answering from `cards` (which a test may change)."""
    state = types.SimpleNamespace(cards=cards, inits=0)

    def memory(handle: Card, version: int | None = None):
        if version is not None and not handle.v2:
            raise NVMLError_FunctionNotFound()
        if version is None:  # v1: the reserve counts as used
            return types.SimpleNamespace(total=handle.total, used=handle.used + handle.reserved)
        return types.SimpleNamespace(
            total=handle.total, reserved=handle.reserved, used=handle.used,
            free=handle.total - handle.reserved - handle.used,
        )  # fmt: skip

    def init() -> None:
        state.inits += 1

    return types.SimpleNamespace(
        state=state,
        NVMLError=NVMLError,
        NVMLError_FunctionNotFound=NVMLError_FunctionNotFound,
        NVMLError_NotSupported=type("NVMLError_NotSupported", (NVMLError,), {}),
        NVMLError_ArgumentVersionMismatch=type("Mismatch", (NVMLError,), {}),
        nvmlMemory_v2=0x2000028,
        nvmlInit=init,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(state.cards),
        nvmlDeviceGetHandleByIndex=lambda i: state.cards[i],
        nvmlDeviceGetUUID=lambda card: card.uuid.encode(),
        nvmlDeviceGetMinorNumber=lambda card: card.minor,
        nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetComputeRunningProcesses=lambda card: [],
        nvmlDeviceGetGraphicsRunningProcesses=lambda card: [],
    )


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch):
    def install(cards: list[Card]) -> types.SimpleNamespace:
        module = fake_nvml(cards)
        monkeypatch.setitem(__import__("sys").modules, "pynvml", module)
        return module

    return install


def test_the_drivers_reserve_is_neither_used_nor_free(nvml) -> None:
    """An idle H200 as NVML v2 reports it: 615 MiB reserved, none used."""
    nvml([Card("GPU-a", 0, total=143771 * MIB, used=0, reserved=615 * MIB)])
    source = NvmlSource()
    (reading,) = source.read()
    assert isinstance(reading, Reading)
    assert (reading.used_mib, reading.total_mib) == (0, 143771 - 615)
    assert source.reserved_mib == {"nvml:0": 615}


def test_a_driver_without_the_v2_query_is_read_with_v1(nvml) -> None:
    module = nvml(
        [Card("GPU-a", 0, total=8192 * MIB, used=1000 * MIB, reserved=300 * MIB, v2=False)]
    )
    source = NvmlSource()
    (reading,) = source.read()
    assert (reading.used_mib, reading.total_mib) == (1300, 8192)  # v1 counts the reserve
    assert source.reserved_mib == {"nvml:0": -1}
    module.state.cards[0].v2 = True  # never asked again: one failed call per card, once
    (reading,) = source.read()
    assert reading.used_mib == 1300


def test_minor_numbers_name_the_cards(nvml) -> None:
    nvml([Card("GPU-a", 3, 8192 * MIB, 0), Card("GPU-b", 1, 8192 * MIB, 0)])
    assert NvmlSource().minor_numbers() == {3: "nvml:0", 1: "nvml:1"}


def test_a_rescan_reinitialises_and_names_the_cards_that_changed(nvml) -> None:
    module = nvml([Card("GPU-a", 0, 8192 * MIB, 0), Card("GPU-b", 1, 8192 * MIB, 0)])
    source = NvmlSource()
    assert [r.card for r in source.read()] == ["nvml:0", "nvml:1"]
    module.state.cards.pop(0)  # GPU-a unplugged: GPU-b is now index 0
    assert source.rescan() == {"nvml:0", "nvml:1"} and module.state.inits == 2
    assert [r.card for r in source.read()] == ["nvml:0"]
    module.state.cards.append(Card("GPU-c", 2, 8192 * MIB, 0))  # added after it
    assert source.rescan() == {"nvml:1"}
    assert source.rescan() == set()  # nothing changed


def test_who_holds_a_cards_memory_is_asked_when_its_use_moves(nvml) -> None:
    """Compute and graphics lists (a process in both counted once); asked again only when
    use moved, and no figure at all where the driver hides one process's (containers,
    WDDM): then whose memory it is cannot be told."""
    module = nvml([Card("GPU-a", 0, total=24576 * MIB, used=23000 * MIB)])
    asked = []

    def compute(card: Card) -> list:
        asked.append(card.used)
        return [types.SimpleNamespace(pid=10, usedGpuMemory=card.used - 300 * MIB)]

    module.nvmlDeviceGetComputeRunningProcesses = compute
    module.nvmlDeviceGetGraphicsRunningProcesses = lambda card: [
        types.SimpleNamespace(pid=20, usedGpuMemory=300 * MIB),
        types.SimpleNamespace(pid=10, usedGpuMemory=card.used - 300 * MIB),
    ]
    source = NvmlSource()
    (reading,) = source.read()
    assert reading.held == ((10, 22700), (20, 300)) and reading.held_by({10}) == 22700
    source.read()
    assert len(asked) == 1  # use has not moved
    module.state.cards[0].used = 23500 * MIB
    (reading,) = source.read()
    assert len(asked) == 2 and reading.held == ((10, 23200), (20, 300))
    module.nvmlDeviceGetGraphicsRunningProcesses = lambda card: [
        types.SimpleNamespace(pid=20, usedGpuMemory=None)
    ]
    module.state.cards[0].used = 24000 * MIB
    (reading,) = source.read()
    assert reading.held is None and reading.held_by({10}) is None
