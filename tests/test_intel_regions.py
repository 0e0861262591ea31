"""Intel i915/xe cards through the driver's memory-region query: answer bytes packed field
by field as the kernel lays them out (include/uapi/drm/i915_drm.h, xe_drm.h), the ioctl
numbers worked out again from the header macros, the capability check on written status
files, and FdinfoSource over trees of real files with recorded answers injected (there is
no Intel card here). The real fcntl path runs once, against /dev/null, which refuses it."""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path

import pytest

from scripts.testbed.memfiles import FakeProcess, drm_node
from watchers import regions
from watchers.fdinfo import FdinfoSource
from watchers.regions import CardMemory, Region, has_perfmon, parse_i915, parse_xe, summarize

GIB = 1024**3
MIB = 1024**2


# -- answers laid out as the uAPI headers say ------------------------------------------------


def i915_answer(*regions: tuple[int, int, int, int]) -> bytes:
    """struct drm_i915_query_memory_regions: u32 num_regions, u32 rsvd[3], then per region
    (memory_class, memory_instance, probed_size, unallocated_size) as
    struct drm_i915_memory_region_info: u16 memory_class, u16 memory_instance, u32 rsvd0,
    u64 probed_size, u64 unallocated_size, u64 rsvd1[8] (88 bytes)."""
    out = struct.pack("<I", len(regions)) + bytes(12)
    for mem_class, instance, probed, unallocated in regions:
        out += struct.pack("<HH", mem_class, instance) + bytes(4)
        out += struct.pack("<QQ", probed, unallocated)
        out += struct.pack("<QQ", probed, unallocated) + bytes(48)  # cpu-visible, rsvd
    return out


def xe_answer(*regions: tuple[int, int, int, int]) -> bytes:
    """struct drm_xe_query_mem_regions: u32 num_mem_regions, u32 pad, then per region
    (mem_class, instance, total_size, used) as struct drm_xe_mem_region: u16 mem_class,
    u16 instance, u32 min_page_size, u64 total_size, u64 used, u64 cpu_visible_size,
    u64 cpu_visible_used, u64 reserved[6] (88 bytes)."""
    out = struct.pack("<II", len(regions), 0)
    for mem_class, instance, total, used in regions:
        out += struct.pack("<HHI", mem_class, instance, 65536)
        out += struct.pack("<QQ", total, used)
        out += struct.pack("<QQ", total, used) + bytes(48)  # cpu-visible, reserved
    return out


def test_ioctl_numbers_follow_the_header_macros() -> None:
    # asm-generic/ioctl.h: _IOC(dir,type,nr,size) = dir<<30 | size<<16 | type<<8 | nr,
    #   _IOC_WRITE 1, _IOC_READ 2; _IOWR = _IOC(_IOC_READ|_IOC_WRITE, ...)
    # drm.h: #define DRM_IOCTL_BASE 'd'; DRM_IOWR(nr,type) _IOWR(DRM_IOCTL_BASE,nr,type);
    #   #define DRM_COMMAND_BASE 0x40
    def iowr(nr: int, size: int) -> int:
        return (2 | 1) << 30 | size << 16 | ord("d") << 8 | nr

    # i915_drm.h: #define DRM_I915_QUERY 0x39; #define DRM_IOCTL_I915_QUERY
    #   DRM_IOWR(DRM_COMMAND_BASE + DRM_I915_QUERY, struct drm_i915_query), that struct
    #   being { __u32 num_items; __u32 flags; __u64 items_ptr; } = 16 bytes
    assert regions.DRM_IOCTL_I915_QUERY == iowr(0x40 + 0x39, 16) == 0xC0106479
    # xe_drm.h: #define DRM_XE_DEVICE_QUERY 0x00; #define DRM_IOCTL_XE_DEVICE_QUERY
    #   DRM_IOWR(DRM_COMMAND_BASE + DRM_XE_DEVICE_QUERY, struct drm_xe_device_query),
    #   { __u64 extensions; __u32 query; __u32 size; __u64 data; __u64 reserved[2]; } = 40
    assert regions.DRM_IOCTL_XE_DEVICE_QUERY == iowr(0x40 + 0x00, 40) == 0xC0286440
    # the query ids: DRM_I915_QUERY_MEMORY_REGIONS 4, DRM_XE_DEVICE_QUERY_MEM_REGIONS 1
    assert regions.DRM_I915_QUERY_MEMORY_REGIONS == 4
    assert regions.DRM_XE_DEVICE_QUERY_MEM_REGIONS == 1
    # struct sizes: the item { u64 query_id; s32 length; u32 flags; u64 data_ptr; } 24
    assert struct.calcsize(regions.I915_ITEM_FORMAT) == 24
    assert struct.calcsize(regions.I915_HEADER) == 16 and struct.calcsize(regions.XE_HEADER) == 8
    assert struct.calcsize(regions.I915_REGION) == struct.calcsize(regions.XE_REGION) == 88
    assert len(i915_answer((1, 0, 1, 1))) == 16 + 88 and len(xe_answer((1, 1, 1, 1))) == 8 + 88


def test_i915_regions_unallocated_says_use_only_when_privileged() -> None:
    answer = i915_answer(
        (0, 0, 32 * GIB, 32 * GIB), (1, 0, 8 * GIB, 6 * GIB), (1, 1, 8 * GIB, 7 * GIB)
    )
    assert parse_i915(answer, privileged=False) == [
        Region(0, 0, 32 * GIB, None),
        Region(1, 0, 8 * GIB, None),
        Region(1, 1, 8 * GIB, None),
    ]
    privileged = parse_i915(answer, privileged=True)
    assert [r.used for r in privileged] == [None, 2 * GIB, 1 * GIB]  # system: not tracked
    assert summarize("i915", privileged, True) == CardMemory(
        16 * 1024, 3 * 1024, "i915 unallocated_size (card-wide)"
    )
    unprivileged = summarize("i915", parse_i915(answer, False), False)
    assert unprivileged.total_mib == 16 * 1024 and unprivileged.used_mib is None
    assert unprivileged.how == "no CAP_PERFMON: sum of visible processes' fdinfo"
    # CapEff says CAP_PERFMON, yet the kernel answered as to anyone (a user namespace)
    same = i915_answer((0, 0, 32 * GIB, 32 * GIB), (1, 0, 8 * GIB, 8 * GIB))
    deaf = summarize("i915", parse_i915(same, True), True)
    assert deaf.total_mib == 8 * 1024 and deaf.used_mib is None and "CAP_PERFMON, yet" in deaf.how


def test_xe_regions_used_reads_zero_without_the_privilege() -> None:
    answer = xe_answer((0, 0, 64 * GIB, 0), (1, 1, 12 * GIB, 0))
    assert parse_xe(answer, privileged=False) == [
        Region(0, 0, 64 * GIB, None),
        Region(1, 1, 12 * GIB, None),
    ]
    assert summarize("xe", parse_xe(answer, True), True).used_mib is None  # all 0: not trusted
    used = xe_answer((0, 0, 64 * GIB, 5 * GIB), (1, 1, 12 * GIB, 3 * GIB), (1, 2, 12 * GIB, GIB))
    assert summarize("xe", parse_xe(used, True), True) == CardMemory(
        24 * 1024, 4 * 1024, "xe used (card-wide)"
    )
    integrated = summarize("xe", parse_xe(xe_answer((0, 0, 64 * GIB, 0)), True), True)
    assert integrated.total_mib is None and "integrated" in integrated.how
    with pytest.raises(ValueError, match="2 regions need"):
        parse_xe(xe_answer((1, 1, GIB, 0), (1, 2, GIB, 0))[:-1], True)


def status(proc: Path, cap_eff: str) -> Path:
    (proc / "self").mkdir(parents=True, exist_ok=True)
    (proc / "self" / "status").write_text(
        f"Name:\tpython3\nState:\tR (running)\nCapInh:\t0000000000000000\n"
        f"CapPrm:\t{cap_eff}\nCapEff:\t{cap_eff}\nCapBnd:\t000001ffffffffff\n"
    )
    return proc


def test_the_capability_check_reads_cap_eff(tmp_path: Path) -> None:
    assert has_perfmon(status(tmp_path / "a", "0000004000000000"))  # bit 38, CAP_PERFMON
    assert has_perfmon(status(tmp_path / "b", "0000000000200000"))  # bit 21, CAP_SYS_ADMIN
    assert has_perfmon(status(tmp_path / "c", "000001ffffffffff"))  # root
    assert not has_perfmon(status(tmp_path / "d", "00000000a80425fb"))  # docker's default set
    assert not has_perfmon(status(tmp_path / "e", "0000000000000000"))
    assert not has_perfmon(status(tmp_path / "f", "garbage"))
    assert not has_perfmon(tmp_path / "nowhere")


def test_the_real_ioctl_on_a_file_that_is_no_drm_node_raises_oserror() -> None:
    for driver in ("i915", "xe"):
        with pytest.raises(OSError) as refused:
            regions.ask_driver(Path("/dev/null"), driver)
        assert refused.value.errno in {25, 22}  # ENOTTY (EINVAL on some kernels)


def test_both_passes_hand_the_kernel_live_buffers(tmp_path: Path, monkeypatch) -> None:
    """A stand-in kernel that follows the pointers as the drivers do: the first pass
    learns the size, the second writes the answer where data_ptr / data points."""
    i915 = i915_answer((0, 0, 32 * GIB, 32 * GIB), (1, 0, 16 * GIB, 16 * GIB))
    xe = xe_answer((0, 0, 32 * GIB, 0), (1, 1, 12 * GIB, 0))

    def kernel(fd: int, request: int, arg: bytearray) -> int:
        if request == regions.DRM_IOCTL_I915_QUERY:
            num_items, flags, items_ptr = struct.unpack("<IIQ", arg)
            assert (num_items, flags) == (1, 0)
            item = (ctypes.c_char * 24).from_address(items_ptr)
            query_id, length, item_flags, data_ptr = struct.unpack_from("<QiIQ", item)
            assert (query_id, item_flags) == (4, 0)
            if length == 0:
                struct.pack_into("<i", item, 8, len(i915))
            else:
                assert length == len(i915) and ctypes.string_at(data_ptr, 16) == bytes(16)
                ctypes.memmove(data_ptr, i915, len(i915))
        else:
            assert request == regions.DRM_IOCTL_XE_DEVICE_QUERY
            extensions, query, size, data, *reserved = struct.unpack("<QIIQ2Q", arg)
            assert (extensions, query, reserved) == (0, 1, [0, 0])
            if size == 0:
                struct.pack_into("<I", arg, 12, len(xe))
            else:
                assert size == len(xe)
                ctypes.memmove(data, xe, size)
        return 0

    monkeypatch.setattr(regions.fcntl, "ioctl", kernel)
    node = tmp_path / "renderD128"
    node.write_bytes(b"")
    assert regions.ask_driver(node, "i915") == i915
    assert regions.ask_driver(node, "xe") == xe


# -- FdinfoSource over a tree of real files ----------------------------------------------------


class Recorded:
    """Answers recorded per render node, standing in for the ioctl."""

    def __init__(self, answers: dict[str, bytes]) -> None:
        self.answers = answers
        self.asked: list[tuple[str, str]] = []

    def __call__(self, node: Path, driver: str) -> bytes:
        self.asked.append((node.name, driver))
        if node.name not in self.answers:
            raise OSError(13, "Permission denied")
        return self.answers[node.name]


def intel_tree(tmp_path: Path, cap_eff: str) -> tuple[Path, Path]:
    """card0: i915 at 0000:03:00.0 (renderD128), held by pid 100 with 1 GiB of VRAM;
    card1: xe at 0000:04:00.0 (renderD129), held by nobody."""
    sysfs, proc = tmp_path / "sys", tmp_path / "proc"
    for card, pdev, render, driver in (
        ("card0", "0000:03:00.0", "renderD128", "i915"),
        ("card1", "0000:04:00.0", "renderD129", "xe"),
    ):
        device = sysfs / "devices" / "pci0000:00" / pdev
        (device / "drm" / card).mkdir(parents=True)
        (device / "drm" / render).mkdir()
        drm_node(sysfs, card, device, driver=driver)
    process = FakeProcess(proc, 100)
    fd = process.open("/dev/dri/renderD128")
    (process.dir / "fdinfo").mkdir()
    (process.dir / "fdinfo" / fd.name).write_text(
        "pos:\t0\ndrm-driver:\ti915\ndrm-pdev:\t0000:03:00.0\ndrm-client-id:\t4\n"
        "drm-total-local0:\t1048576 KiB\ndrm-resident-local0:\t1048576 KiB\n"
        "drm-resident-system:\t4096 KiB\n"
    )
    status(proc, cap_eff)
    return sysfs, proc


def by_card(source: FdinfoSource) -> dict[str, tuple[float, float | None]]:
    return {r.card: (r.used_mib, r.total_mib) for r in source.read()}


def test_unprivileged_intel_cards_get_their_total_and_fdinfo_use(tmp_path: Path) -> None:
    sysfs, proc = intel_tree(tmp_path, "0000000000000000")
    query = Recorded(
        {
            "renderD128": i915_answer((0, 0, 32 * GIB, 32 * GIB), (1, 0, 16 * GIB, 16 * GIB)),
            "renderD129": xe_answer((0, 0, 32 * GIB, 0), (1, 1, 12 * GIB, 0)),
        }
    )
    source = FdinfoSource(proc, sysfs, tmp_path / "dev", query=query)
    assert by_card(source) == {"drm:card0": (1024, 16 * 1024), "drm:card1": (0, 12 * 1024)}
    assert source.pids == {"drm:card0": {100}}
    assert source.measured == {
        "drm:card0": "no CAP_PERFMON: sum of visible processes' fdinfo",
        "drm:card1": "no CAP_PERFMON: sum of visible processes' fdinfo",
    }
    by_card(source)
    assert sorted(query.asked) == [("renderD128", "i915"), ("renderD129", "xe")]  # per rescan


def test_privileged_intel_cards_are_measured_card_wide(tmp_path: Path) -> None:
    sysfs, proc = intel_tree(tmp_path, "0000004000000000")
    query = Recorded(
        {
            "renderD128": i915_answer((0, 0, 32 * GIB, 32 * GIB), (1, 0, 16 * GIB, 10 * GIB)),
            "renderD129": xe_answer((0, 0, 32 * GIB, GIB), (1, 1, 12 * GIB, 3 * GIB)),
        }
    )
    source = FdinfoSource(proc, sysfs, tmp_path / "dev", query=query)
    assert by_card(source) == {
        "drm:card0": (6 * 1024, 16 * 1024),
        "drm:card1": (3 * 1024, 12 * 1024),
    }
    assert source.measured == {
        "drm:card0": "i915 unallocated_size (card-wide)",
        "drm:card1": "xe used (card-wide)",
    }
    query.answers["renderD129"] = xe_answer((0, 0, 32 * GIB, GIB), (1, 1, 12 * GIB, 11 * GIB))
    assert by_card(source)["drm:card1"] == (11 * 1024, 12 * 1024)  # asked again: use moves
    del query.answers["renderD128"]  # the node went away between two reads
    assert by_card(source)["drm:card0"] == (1024, 16 * 1024)  # fdinfo, against the total
    assert "failed" in source.measured["drm:card0"]


def test_a_refused_region_query_leaves_the_fdinfo_sum(tmp_path: Path) -> None:
    sysfs, proc = intel_tree(tmp_path, "0000004000000000")
    source = FdinfoSource(proc, sysfs, tmp_path / "dev", query=Recorded({}))
    assert by_card(source) == {"drm:card0": (1024, None)}  # card1: nothing known, no client
    assert source.measured["drm:card0"].startswith("region query on ")


def test_the_real_ioctl_path_through_the_source_is_not_measured(tmp_path: Path) -> None:
    sysfs, proc = intel_tree(tmp_path, "0000000000000000")
    (tmp_path / "dev" / "dri").mkdir(parents=True)
    for node in ("renderD128", "renderD129"):
        os.symlink("/dev/null", tmp_path / "dev" / "dri" / node)
    source = FdinfoSource(proc, sysfs, tmp_path / "dev")  # the real ask_driver
    assert by_card(source) == {"drm:card0": (1024, None)}
    assert "Inappropriate ioctl" in source.measured["drm:card0"]
