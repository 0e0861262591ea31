"""NVIDIA cards through NVML (nvidia-ml-py): memory per card, and which processes use it."""

from __future__ import annotations

import time

from watchers.reading import MIB, CardFailure, NotApplicable, Reading


def card_id(index: int) -> str:
    return f"nvml:{index}"


class NvmlSource:
    name = "nvml"

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError:
            raise NotApplicable("nvidia-ml-py is not installed: pip install nvidia-ml-py") from None
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            raise NotApplicable(
                f"NVML unavailable ({exc}): no NVIDIA driver here, or it is not loaded "
                "(check nvidia-smi)"
            ) from None
        self._nvml = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]

    def read(self) -> list[Reading | CardFailure]:
        readings: list[Reading | CardFailure] = []
        for index, handle in enumerate(self.handles):
            try:
                memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            except self._nvml.NVMLError as exc:
                readings.append(CardFailure(card_id(index), str(exc)))
                continue
            readings.append(
                Reading(card_id(index), memory.used / MIB, memory.total / MIB, time.monotonic())
            )
        return readings

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
