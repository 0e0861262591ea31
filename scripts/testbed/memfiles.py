"""Trees of real files standing in for sysfs and procfs, written and changed by tests,
the demo and the benchmarks."""

from __future__ import annotations

import os
from pathlib import Path

MIB = 1024 * 1024


class FakeCard:
    """/sys/class/drm/cardN with amdgpu's VRAM counters (in bytes, as the kernel writes)."""

    def __init__(
        self, sysfs: Path, name: str, total_mib: int, used_mib: int, pdev: str = ""
    ) -> None:
        self.name = name
        pci = sysfs / "devices" / (pdev or f"0000:0{name[-1]}:00.0")
        pci.mkdir(parents=True, exist_ok=True)
        card = sysfs / "class" / "drm" / name
        card.mkdir(parents=True, exist_ok=True)
        (card / "device").symlink_to(pci)
        self.device = pci
        (pci / "mem_info_vram_total").write_text(f"{total_mib * MIB}\n")
        (pci / "uevent").write_text("DRIVER=amdgpu\n")  # node_exporter's drm collector asks
        self.set_used(used_mib)

    def set_used(self, used_mib: int) -> None:
        write_in_place(self.device / "mem_info_vram_used", f"{used_mib * MIB:>20}\n")


def write_meminfo(path: Path, total_mib: int, available_mib: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_in_place(
        path,
        f"MemTotal:       {total_mib * 1024:>12} kB\n"
        f"MemFree:        {available_mib * 1024:>12} kB\n"
        f"MemAvailable:   {available_mib * 1024:>12} kB\n"
        f"Buffers:                   0 kB\n",
    )


def write_in_place(path: Path, text: str) -> None:
    """One pwrite of a fixed-width value, as the kernel's files never change inode: the
    watchers keep them open and re-read from offset 0."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, text.encode(), 0)
    finally:
        os.close(fd)


def mem_available_mib() -> float:
    return _meminfo_mib("MemAvailable")


def mem_total_mib() -> float:
    return _meminfo_mib("MemTotal")


def _meminfo_mib(field: str) -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/meminfo")


class FakeProcess:
    """/proc/<pid> with its comm and descriptors: fd/<n> symlinks to what it holds open. The
    targets need not exist (the readers take the link's text, as for /dev/nvidia1 here)."""

    def __init__(self, proc: Path, pid: int, comm: str = "llama-server") -> None:
        self.proc = proc
        self.pid = pid
        self.dir = proc / str(pid)
        (self.dir / "fd").mkdir(parents=True, exist_ok=True)
        (self.dir / "comm").write_text(f"{comm}\n")

    def open(self, target: str | Path) -> Path:
        fd = self.dir / "fd" / str(3 + len(list((self.dir / "fd").iterdir())))
        fd.symlink_to(target)
        return fd

    def start(self, child: FakeProcess) -> None:
        """`child` is a process this one started (its main thread's children list)."""
        children = self.dir / "task" / str(self.pid) / "children"
        children.parent.mkdir(parents=True, exist_ok=True)
        known = children.read_text() if children.exists() else ""
        children.write_text(f"{known}{child.pid} ")

    def listen(self, port: int, inode: int, uid: int = 0) -> None:
        """A listening TCP socket on `port`, in proc/net/tcp and among the descriptors."""
        add_listening_socket(self.proc, port, inode, uid)
        self.open(f"socket:[{inode}]")


def add_listening_socket(proc: Path, port: int, inode: int, uid: int = 0) -> None:
    """One listening line of /proc/net/tcp (127.0.0.1:port), in the kernel's layout."""
    table = proc / "net" / "tcp"
    if not table.exists():
        table.parent.mkdir(parents=True, exist_ok=True)
        table.write_text(
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt"
            "   uid  timeout inode\n"
        )
    rows = len(table.read_text().splitlines()) - 1
    with table.open("a") as out:
        out.write(
            f"{rows:4}: 0100007F:{port:04X} 00000000:0000 0A 00000000:00000000 00:00000000 "
            f"00000000 {uid:5} 0 {inode} 1 0000000000000000 100 0 0 10 0\n"
        )


def drm_node(sysfs: Path, name: str, device: Path, driver: str = "") -> None:
    """/sys/class/drm/<name> (cardN or renderDN) of `device`, its /sys/dev/char/226:<minor>
    link, and where `driver` is given the device's driver link (e.g. "nvidia")."""
    node = sysfs / "class" / "drm" / name
    node.mkdir(parents=True, exist_ok=True)
    if not (node / "device").is_symlink():
        (node / "device").symlink_to(device)
    char = sysfs / "dev" / "char" / f"226:{name.removeprefix('card').removeprefix('renderD')}"
    char.parent.mkdir(parents=True, exist_ok=True)
    char.symlink_to(node)
    if driver:
        drivers = sysfs / "bus" / "pci" / "drivers" / driver
        drivers.mkdir(parents=True, exist_ok=True)
        (device / "driver").symlink_to(drivers)
