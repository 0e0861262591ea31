"""Which cards a process holds open, read from its file descriptors: `/dev/nvidia<N>` names
an NVIDIA card by its minor number, `/dev/dri/renderD<N>` and `/dev/dri/card<N>` a DRM
card. The fallback for servers that NVML and fdinfo do not show by pid (NVML hides the
processes of other PID namespaces, so a server in a container is not listed).

Where the descriptor can be stat'ed, its device number decides, not its name: a container
may give a device another name (`--device /dev/nvidia1:/dev/nvidia0`).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from watchers.sysfs import card_id, drm_cards

NVIDIA_MAJOR = 195  # fixed by the driver: 195:N is /dev/nvidia<N>...
NVIDIA_CONTROL_MINORS = {254, 255}  # ...but 254 is nvidia-modeset and 255 nvidiactl
DRM_MAJOR = 226


@dataclass(frozen=True)
class DeviceFile:
    path: str  # the descriptor's target as its process names it
    rdev: tuple[int, int] | None  # (major, minor) of the character device, where stat could tell


@dataclass(frozen=True)
class Found:
    card: str | None  # None: a GPU device file that names no card we can read
    note: str  # for people: "/dev/nvidia1 -> nvml:0", or why it maps to no card


def open_devices(pid: int, proc: Path = Path("/proc"), dev: str = "/dev") -> list[DeviceFile]:
    """The device files `pid` holds open. Raises PermissionError when its descriptors are
    not ours to read, FileNotFoundError when it is gone."""
    devices = []
    for fd in (proc / str(pid) / "fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if not target.startswith(f"{dev}/"):
            continue  # sockets, pipes, files: only device files are stat'ed (no NFS waits)
        try:
            st = os.stat(fd)
        except OSError:
            devices.append(DeviceFile(target, None))  # gone, or a test tree's dangling link
            continue
        if stat.S_ISCHR(st.st_mode):
            devices.append(DeviceFile(target, (os.major(st.st_rdev), os.minor(st.st_rdev))))
    return devices


class DeviceCards:
    """Device files -> card ids: NVIDIA minors through NVML's `minors` (minor -> "nvml:I"),
    DRM nodes through sysfs to the "drm:cardK" the sysfs and fdinfo sources read."""

    def __init__(self, minors: dict[int, str], sysfs: Path = Path("/sys"), dev: str = "/dev"):
        self.minors = minors
        self.sys = sysfs
        self._nvidia = re.compile(re.escape(dev) + r"/nvidia(\d+)")
        self._drm = re.compile(re.escape(dev) + r"/dri/((?:renderD|card)\d+)")
        self._cards = {
            os.path.realpath(card / "device"): card_id(card.name) for card in drm_cards(sysfs)
        }

    def identify(self, device: DeviceFile) -> Found | None:
        """None for a file that is no GPU device (nvidiactl, nvidia-uvm, /dev/null...)."""
        minor = self._nvidia_minor(device)
        if minor is not None:
            card = self.minors.get(minor)
            if card is None:
                return Found(None, f"{device.path}: no NVML card has minor {minor}")
            return Found(card, f"{device.path} -> {card}")
        pci = self._drm_device(device)
        if pci is None:
            return None
        if not pci:
            return Found(None, f"{device.path}: a DRM node {self.sys} does not show")
        if os.path.basename(os.path.realpath(Path(pci) / "driver")) == "nvidia":
            # nvidia-drm's nodes: no source reads memory through them, and every NVIDIA
            # user (CUDA, Vulkan, GL) also opens /dev/nvidia<N>, which names the NVML card.
            return Found(None, f"{device.path}: an NVIDIA card's DRM node (not counted)")
        card = self._cards.get(pci)
        if card is None:
            return Found(None, f"{device.path}: no DRM card in {self.sys}/class/drm has it")
        return Found(card, f"{device.path} -> {card}")

    def _nvidia_minor(self, device: DeviceFile) -> int | None:
        if device.rdev is not None:
            major, minor = device.rdev
            if major == NVIDIA_MAJOR and minor not in NVIDIA_CONTROL_MINORS:
                return minor
            return None
        match = self._nvidia.fullmatch(device.path)
        return int(match[1]) if match else None

    def _drm_device(self, device: DeviceFile) -> str | None:
        """The (PCI) device behind a DRM node as sysfs resolves it; None for no DRM node,
        "" for one sysfs does not show."""
        match = self._drm.fullmatch(device.path)
        if device.rdev is not None:
            if device.rdev[0] != DRM_MAJOR:
                return None
            link = self.sys / "dev" / "char" / "{}:{}".format(*device.rdev) / "device"
            if link.exists():
                return os.path.realpath(link)
        elif match is None:
            return None
        if match is None:
            return ""
        link = self.sys / "class" / "drm" / match[1] / "device"
        return os.path.realpath(link) if link.exists() else ""
