"""Intel Arc cards (i915, xe): the card's memory total, and card-wide use where the driver
gives it, from the driver's memory-region query ioctl on the card's render node. Layouts
and numbers follow include/uapi/drm/{drm,i915_drm,xe_drm}.h and asm-generic/ioctl.h.

Both drivers report use only to CAP_PERFMON or CAP_SYS_ADMIN (in the initial user
namespace); without it xe's `used` reads 0 and i915's `unallocated_size` equals
`probed_size`, and the caller falls back to the fdinfo sum of the processes it can see.
This module has not yet met real Intel hardware: it is tested against struct bytes laid
out as the headers say, and against a real ioctl refused by a file that is no DRM node."""

from __future__ import annotations

import ctypes
import fcntl
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from watchers.reading import MIB

# asm-generic/ioctl.h (x86, arm, riscv; not alpha/mips/powerpc/sparc, which move the bits)
IOC_WRITE, IOC_READ = 1, 2
IOC_NRSHIFT, IOC_TYPESHIFT, IOC_SIZESHIFT, IOC_DIRSHIFT = 0, 8, 16, 30
DRM_IOCTL_BASE = ord("d")  # drm.h
DRM_COMMAND_BASE = 0x40  # drm.h


def drm_iowr(nr: int, size: int) -> int:
    """drm.h's DRM_IOWR(nr, type) = _IOWR('d', nr, type)."""
    return (
        (IOC_READ | IOC_WRITE) << IOC_DIRSHIFT
        | DRM_IOCTL_BASE << IOC_TYPESHIFT
        | nr << IOC_NRSHIFT
        | size << IOC_SIZESHIFT
    )


# i915_drm.h: struct drm_i915_query { u32 num_items; u32 flags; u64 items_ptr; } and
# struct drm_i915_query_item { u64 query_id; s32 length; u32 flags; u64 data_ptr; }
I915_QUERY_FORMAT, I915_ITEM_FORMAT = "=IIQ", "=QiIQ"
DRM_I915_QUERY = 0x39
DRM_I915_QUERY_MEMORY_REGIONS = 4
DRM_IOCTL_I915_QUERY = drm_iowr(
    DRM_COMMAND_BASE + DRM_I915_QUERY, struct.calcsize(I915_QUERY_FORMAT)
)
# struct drm_i915_query_memory_regions { u32 num_regions; u32 rsvd[3]; regions[] }, each
# { u16 memory_class; u16 memory_instance; u32 rsvd0; u64 probed_size;
#   u64 unallocated_size; u64 rsvd1[8] (probed/unallocated_cpu_visible_size) }
I915_HEADER, I915_REGION = "=I3I", "=HHIQQ8Q"

# xe_drm.h: struct drm_xe_device_query { u64 extensions; u32 query; u32 size; u64 data;
# u64 reserved[2]; }
XE_QUERY_FORMAT = "=QIIQ2Q"
DRM_XE_DEVICE_QUERY = 0x00
DRM_XE_DEVICE_QUERY_MEM_REGIONS = 1
DRM_IOCTL_XE_DEVICE_QUERY = drm_iowr(
    DRM_COMMAND_BASE + DRM_XE_DEVICE_QUERY, struct.calcsize(XE_QUERY_FORMAT)
)
# struct drm_xe_query_mem_regions { u32 num_mem_regions; u32 pad; mem_regions[] }, each
# { u16 mem_class; u16 instance; u32 min_page_size; u64 total_size; u64 used;
#   u64 cpu_visible_size; u64 cpu_visible_used; u64 reserved[6] }
XE_HEADER, XE_REGION = "=II", "=HHIQQQQ6Q"

DEVICE_CLASS = 1  # I915_MEMORY_CLASS_DEVICE, DRM_XE_MEM_REGION_CLASS_VRAM (0: system)
CAP_SYS_ADMIN, CAP_PERFMON = 21, 38  # linux/capability.h
FDINFO_SUM = "sum of visible processes' fdinfo"
Query = Callable[[Path, str], bytes]  # (render node, driver) -> the driver's answer bytes


@dataclass(frozen=True)
class Region:
    mem_class: int
    instance: int
    total: int  # bytes
    used: int | None  # bytes; None where the driver does not say (unprivileged)

    @property
    def device(self) -> bool:
        return self.mem_class == DEVICE_CLASS


@dataclass(frozen=True)
class CardMemory:
    total_mib: float | None  # device-class regions together; None: no VRAM (integrated)
    used_mib: float | None  # card-wide; None: the caller sums fdinfo instead
    how: str  # where used comes from, or why not card-wide


def _regions(data: bytes, header: str, layout: str) -> list[tuple[int, ...]]:
    (count,) = struct.unpack_from("=I", data)  # both answers open with a u32 count
    start, size = struct.calcsize(header), struct.calcsize(layout)
    if len(data) < start + count * size:
        raise ValueError(f"{count} regions need {start + count * size} bytes, got {len(data)}")
    return [struct.unpack_from(layout, data, start + i * size) for i in range(count)]


def parse_i915(data: bytes, privileged: bool) -> list[Region]:
    regions = []
    for mem_class, instance, _, probed, unallocated, *_ in _regions(data, I915_HEADER, I915_REGION):
        known = privileged and mem_class == DEVICE_CLASS and unallocated <= probed
        regions.append(Region(mem_class, instance, probed, probed - unallocated if known else None))
    return regions


def parse_xe(data: bytes, privileged: bool) -> list[Region]:
    return [
        Region(mem_class, instance, total, used if privileged else None)
        for mem_class, instance, _, total, used, *_ in _regions(data, XE_HEADER, XE_REGION)
    ]


def summarize(driver: str, regions: list[Region], privileged: bool) -> CardMemory:
    vram = [r for r in regions if r.device]
    if not vram:
        return CardMemory(None, None, f"no device-memory region (integrated GPU): {FDINFO_SUM}")
    total = sum(r.total for r in vram) / MIB
    if not privileged:
        return CardMemory(total, None, f"no CAP_PERFMON: {FDINFO_SUM}")
    # With the capability in CapEff but not in the initial user namespace (a container),
    # the driver answers as to anyone: xe says 0 used, i915 says all of it unallocated.
    if any(r.used is None for r in vram) or not any(r.used for r in vram):
        return CardMemory(total, None, f"CAP_PERFMON, yet no card-wide figure: {FDINFO_SUM}")
    what = "xe used" if driver == "xe" else "i915 unallocated_size"
    return CardMemory(total, sum(r.used or 0 for r in vram) / MIB, f"{what} (card-wide)")


def _query_i915(fd: int) -> bytes:
    item = ctypes.create_string_buffer(struct.calcsize(I915_ITEM_FORMAT))
    query = struct.pack(I915_QUERY_FORMAT, 1, 0, ctypes.addressof(item))
    struct.pack_into(I915_ITEM_FORMAT, item, 0, DRM_I915_QUERY_MEMORY_REGIONS, 0, 0, 0)
    fcntl.ioctl(fd, DRM_IOCTL_I915_QUERY, bytearray(query))  # pass 1: the kernel sets length
    length = struct.unpack_from(I915_ITEM_FORMAT, item)[1]
    if length <= 0:  # a failed item reports -errno in its length; the ioctl itself returns 0
        raise OSError(-length, os.strerror(-length) if length else "empty answer")
    data = ctypes.create_string_buffer(length)  # zeroed: i915 refuses nonzero num_regions/rsvd
    struct.pack_into(
        I915_ITEM_FORMAT, item, 0, DRM_I915_QUERY_MEMORY_REGIONS, length, 0, ctypes.addressof(data)
    )
    fcntl.ioctl(fd, DRM_IOCTL_I915_QUERY, bytearray(query))
    if (written := struct.unpack_from(I915_ITEM_FORMAT, item)[1]) < 0:
        raise OSError(-written, os.strerror(-written))
    return data.raw[:written]


def _query_xe(fd: int) -> bytes:
    query = bytearray(struct.pack(XE_QUERY_FORMAT, 0, DRM_XE_DEVICE_QUERY_MEM_REGIONS, 0, 0, 0, 0))
    fcntl.ioctl(fd, DRM_IOCTL_XE_DEVICE_QUERY, query)  # pass 1: the kernel sets size
    if not (size := struct.unpack_from(XE_QUERY_FORMAT, query)[2]):
        raise OSError(0, "empty answer")
    data = ctypes.create_string_buffer(size)  # xe refuses any size but the exact one
    address = ctypes.addressof(data)  # `data` stays referenced until the kernel has written
    query = struct.pack(XE_QUERY_FORMAT, 0, DRM_XE_DEVICE_QUERY_MEM_REGIONS, size, address, 0, 0)
    fcntl.ioctl(fd, DRM_IOCTL_XE_DEVICE_QUERY, bytearray(query))
    return data.raw


def ask_driver(node: Path, driver: str) -> bytes:
    """The driver's memory-region answer, asked on an open render node; OSError when the
    node cannot be opened or the ioctl is refused (ENOTTY on a file that is no DRM node)."""
    ask = {"i915": _query_i915, "xe": _query_xe}[driver]
    fd = os.open(node, os.O_RDWR | os.O_CLOEXEC)
    try:
        return ask(fd)
    finally:
        os.close(fd)


def has_perfmon(proc_root: Path = Path("/proc")) -> bool:
    """CAP_PERFMON or CAP_SYS_ADMIN in this process's effective set."""
    try:
        for line in (proc_root / "self" / "status").read_text().splitlines():
            if line.startswith("CapEff:"):
                caps = int(line.split(":", 1)[1], 16)
                return bool(caps >> CAP_PERFMON & 1 or caps >> CAP_SYS_ADMIN & 1)
    except (OSError, ValueError):
        pass
    return False


def driver_of(card_dir: Path) -> str:
    return os.path.basename(os.path.realpath(card_dir / "device" / "driver"))


def render_node(card_dir: Path, dev_root: Path = Path("/dev")) -> Path | None:
    nodes = sorted((card_dir / "device" / "drm").glob("renderD*"))
    return dev_root / "dri" / nodes[0].name if nodes else None


def card_memory(
    card_dir: Path, driver: str, privileged: bool, dev_root: Path, query: Query
) -> CardMemory:
    """What the region query says of an i915 or xe card; a failure says why, not raises."""
    if (node := render_node(card_dir, dev_root)) is None:
        return CardMemory(None, None, f"no render node: {FDINFO_SUM}")
    try:
        answer = query(node, driver)
        regions = (parse_xe if driver == "xe" else parse_i915)(answer, privileged)
    except (OSError, ValueError, struct.error) as exc:
        return CardMemory(None, None, f"region query on {node} failed ({exc}): {FDINFO_SUM}")
    return summarize(driver, regions, privileged)
