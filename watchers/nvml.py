"""NVIDIA cards through NVML (nvidia-ml-py): memory per card, which processes use it, and
each card's device minor number (/dev/nvidia<N>)."""

from __future__ import annotations

import time

from watchers.reading import MIB, CardFailure, NotApplicable, Reading

HELD_EVERY_S = 5.0  # who holds a card's memory is asked again this often, or on a change
HELD_CHANGE_MIB = 8.0


def card_id(index: int) -> str:
    return f"nvml:{index}"


class NvmlSource:
    name = "nvml"

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError:
            raise NotApplicable("nvidia-ml-py is not installed: pip install nvidia-ml-py") from None
        self._nvml = pynvml
        self._v1_only = (
            pynvml.NVMLError_FunctionNotFound,  # a driver older than the v2 query
            pynvml.NVMLError_NotSupported,
            pynvml.NVMLError_ArgumentVersionMismatch,
        )
        self.handles: list = []
        self.uuids: list[str] = []
        self.reserved_mib: dict[str, float] = {}  # the driver's own reserve, where v2 tells
        # card -> (used when asked, when, (pid, MiB) pairs or None): the process lists
        # cost more than the memory query, so they are asked only when use moved.
        self._held: dict[str, tuple[float, float, tuple[tuple[int, float], ...] | None]] = {}
        try:
            pynvml.nvmlInit()
            self._enumerate()
        except pynvml.NVMLError as exc:
            raise NotApplicable(
                f"NVML unavailable ({exc}): no NVIDIA driver here, or it is not loaded "
                "(check nvidia-smi)"
            ) from None

    def _enumerate(self) -> None:
        nvml = self._nvml
        count = nvml.nvmlDeviceGetCount()
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self.uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in self.handles]

    def rescan(self) -> set[str]:
        """Re-initialise NVML after a PCI hotplug event (its card list is fixed at init):
        the cards whose index now names another card, or none, are returned (forget them)."""
        nvml, before = self._nvml, list(self.uuids)
        try:
            nvml.nvmlShutdown()
            nvml.nvmlInit()
            self._enumerate()
        except nvml.NVMLError:
            self.handles, self.uuids = [], []
        count = max(len(before), len(self.uuids))
        return {
            card_id(i)
            for i in range(count)
            if (before[i] if i < len(before) else None)
            != (self.uuids[i] if i < len(self.uuids) else None)
        }

    def read(self) -> list[Reading | CardFailure]:
        readings: list[Reading | CardFailure] = []
        for index, handle in enumerate(self.handles):
            card = card_id(index)
            try:
                used, total = self._memory(card, handle)
            except self._nvml.NVMLError as exc:
                readings.append(CardFailure(card, str(exc)))
                continue
            now = time.monotonic()
            readings.append(
                Reading(card, used, total, now, held=self._holders(card, handle, used, now))
            )
        return readings

    def _holders(
        self, card: str, handle, used: float, now: float
    ) -> tuple[tuple[int, float], ...] | None:
        """(pid, MiB) for each process on the card, asked again when its use moved or
        every HELD_EVERY_S; None where the driver does not say (some hide the figure)."""
        known = self._held.get(card)
        if (
            known is not None
            and abs(known[0] - used) < HELD_CHANGE_MIB
            and now - known[1] < HELD_EVERY_S
        ):
            return known[2]
        nvml, held = self._nvml, {}
        try:
            for query in (
                nvml.nvmlDeviceGetComputeRunningProcesses,
                nvml.nvmlDeviceGetGraphicsRunningProcesses,
            ):
                for process in query(handle):
                    if process.usedGpuMemory is None:
                        raise LookupError  # hidden: whose memory it is cannot be told
                    held[process.pid] = max(held.get(process.pid, 0.0), process.usedGpuMemory / MIB)
            pairs: tuple[tuple[int, float], ...] | None = tuple(sorted(held.items()))
        except (nvml.NVMLError, LookupError):
            pairs = None
        self._held[card] = (used, now, pairs)
        return pairs

    def _memory(self, card: str, handle) -> tuple[float, float]:
        """(used, usable total) in MiB. NVML's v2 query counts the driver's reserve (about
        615 MiB on an idle H200) apart from used memory: it is neither used by anyone nor
        ever free, so it leaves the total. v1 (older drivers) counts it as used."""
        nvml = self._nvml
        if card not in self.reserved_mib or self.reserved_mib[card] >= 0:
            try:
                memory = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
                self.reserved_mib[card] = memory.reserved / MIB
                return memory.used / MIB, (memory.total - memory.reserved) / MIB
            except self._v1_only:
                self.reserved_mib[card] = -1  # v1 only: do not ask again
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        return memory.used / MIB, memory.total / MIB

    def minor_numbers(self) -> dict[int, str]:
        """/dev/nvidia<N> minor number -> card, for mapping a process by its open devices."""
        minors: dict[int, str] = {}
        for index, handle in enumerate(self.handles):
            try:
                minors[self._nvml.nvmlDeviceGetMinorNumber(handle)] = card_id(index)
            except self._nvml.NVMLError:
                continue
        return minors

    def processes(self) -> dict[int, set[str]]:
        """pid -> cards it has memory on (where the driver tells; some hide other users')."""
        found: dict[int, set[str]] = {}
        nvml = self._nvml
        for index, handle in enumerate(self.handles):
            for query in (
                nvml.nvmlDeviceGetComputeRunningProcesses,
                nvml.nvmlDeviceGetGraphicsRunningProcesses,
            ):
                try:
                    for process in query(handle):
                        found.setdefault(process.pid, set()).add(card_id(index))
                except nvml.NVMLError:
                    continue
        return found


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
