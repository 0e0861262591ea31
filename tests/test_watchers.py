"""Memory sources, pressure lines, the monitor thread, hotplug and gates, on real files."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from scripts.testbed.memfiles import FakeCard, write_meminfo
from tests.listener import listening_process
from watchers import gates, sockdiag
from watchers.fdinfo import FdinfoSource, parse_fdinfo
from watchers.gates import IN_RAM, CardMap, listening_pids, parse_card_map
from watchers.hotplug import HotplugEvents, UdevObserver, pci_cards, what_is_seen
from watchers.listeners import find_listeners, listed
from watchers.meminfo import MeminfoSource
from watchers.monitor import MemoryMonitor
from watchers.nvml import NvmlSource
from watchers.pressure import CardState, Crossing, Lines
from watchers.reading import CardFailure, NotApplicable, Reading
from watchers.sources import open_sources
from watchers.sysfs import SysfsVramSource


def test_sysfs_source_reads_real_files(tmp_path: Path) -> None:
    FakeCard(tmp_path, "card0", total_mib=16384, used_mib=4096)
    (tmp_path / "class/drm/card0-DP-1").mkdir()  # a connector, not a card
    (tmp_path / "class/drm/card1/device").mkdir(parents=True)  # a card without VRAM files
    source = SysfsVramSource(tmp_path)
    (reading,) = source.read()
    assert reading.card == "drm:card0"
    assert (reading.used_mib, reading.total_mib, reading.free_mib) == (4096, 16384, 12288)


def test_sysfs_source_reports_a_garbled_card(tmp_path: Path) -> None:
    card = FakeCard(tmp_path, "card0", total_mib=16384, used_mib=4096)
    (card.device / "mem_info_vram_used").write_text("garbage\n")
    (failure,) = SysfsVramSource(tmp_path).read()
    assert isinstance(failure, CardFailure) and "garbage" in failure.error


def nvml_or_why() -> NvmlSource | str:
    """NVML as this machine has it: the source, or why it does not apply here."""
    try:
        return NvmlSource()
    except NotApplicable as exc:
        return str(exc)


def test_sources_say_why_they_do_not_apply(tmp_path: Path) -> None:
    sources, missing = open_sources(
        ["sysfs", "fdinfo", "meminfo", "nvml", "bogus"], tmp_path, tmp_path
    )
    assert "no " in missing["sysfs"] and "class/drm" in missing["sysfs"]
    assert "fdinfo" in missing
    assert "meminfo" in missing["meminfo"]
    assert "unknown source" in missing["bogus"]
    # NVML is not under the test's roots: it applies exactly where the machine has it.
    nvml = nvml_or_why()
    if isinstance(nvml, str):
        assert sources == [] and missing["nvml"] == nvml
        assert "NVML unavailable" in nvml and "driver" in nvml
    else:
        assert [source.name for source in sources] == ["nvml"] and "nvml" not in missing


def test_meminfo_source_reads_real_and_test_files(tmp_path: Path) -> None:
    write_meminfo(tmp_path / "meminfo", total_mib=24000, available_mib=6000)
    (fake,) = MeminfoSource(tmp_path / "meminfo").read()
    assert (fake.used_mib, fake.total_mib) == (18000, 24000)
    real = Path("/proc/meminfo")
    if not os.access(real, os.R_OK):
        with pytest.raises(NotApplicable, match="cannot be read"):
            MeminfoSource(real)
        return
    (reading,) = MeminfoSource(real).read()
    assert reading.card == "ram" and 0 < reading.used_mib < reading.total_mib


def test_nvml_at_its_boundary() -> None:
    """The real nvidia-ml-py: on a machine without the NVIDIA driver it must say so; on one
    with it, every card reads with a total."""
    nvml = nvml_or_why()
    if isinstance(nvml, str):
        assert "NVML unavailable" in nvml and "driver" in nvml
        return
    readings = nvml.read()
    assert [r.card for r in readings] == [f"nvml:{i}" for i in range(len(nvml.handles))]
    for r in readings:
        assert isinstance(r, Reading), r
        assert r.total_mib and r.total_mib > 0 and 0 <= r.used_mib <= r.total_mib
    cards = {r.card for r in readings}
    assert all(held <= cards for held in nvml.processes().values())


def test_fdinfo_counts_device_memory_per_card(tmp_path: Path) -> None:
    sysfs, proc = tmp_path / "sys", tmp_path / "proc"
    FakeCard(sysfs, "card0", total_mib=8192, used_mib=0, pdev="0000:03:00.0")
    for pid, fd, client, vram in ((100, 5, 1, 2048), (100, 6, 1, 2048), (200, 3, 2, 1024)):
        (proc / str(pid) / "fd").mkdir(parents=True, exist_ok=True)
        (proc / str(pid) / "fdinfo").mkdir(exist_ok=True)
        os.symlink("/dev/dri/renderD128", proc / str(pid) / "fd" / str(fd))
        (proc / str(pid) / "fdinfo" / str(fd)).write_text(
            f"pos:\t0\ndrm-driver:\txe\ndrm-pdev:\t0000:03:00.0\ndrm-client-id:\t{client}\n"
            f"drm-total-vram0:\t{vram * 1024} KiB\ndrm-resident-vram0:\t{vram * 1024} KiB\n"
            f"drm-resident-system:\t999 KiB\n"
        )
    os.symlink("/dev/null", proc / "200" / "fd" / "9")  # not a DRM fd
    (reading,) = FdinfoSource(proc, sysfs).read()
    # client 1 holds two fds on one client id: counted once
    assert reading.card == "drm:card0" and reading.used_mib == 3072 and reading.total_mib == 8192
    assert parse_fdinfo("pos:\t0\nflags:\t02\n") is None


def reading(used: float, at: float, total: float | None = 16384) -> Reading:
    return Reading("drm:card0", used, total, at)


LINES = Lines()  # the defaults: on a 16 GiB card a floor of 512 MiB, re-armed at 1,536 free


def feed(state: CardState, values: list[float], total: float | None = 16384) -> list[str | None]:
    crossings = [state.observe(reading(v, i * 0.02, total), LINES) for i, v in enumerate(values)]
    return [c.line if c else None for c in crossings]


def test_a_step_fires_once_confirmed() -> None:
    """The spillover report's shape: flat KV cache, then another process loads 5,041 MiB."""
    fired = feed(CardState("drm:card0"), [10000] * 5 + [15041, 15041, 15041, 15041])
    assert fired[:6] == [None] * 6
    assert fired[6] is not None and "step +5,041 MiB" in fired[6] and "1,343 MiB left" in fired[6]
    assert fired[7:] == [None, None]  # no second fire while still under pressure


def test_one_noisy_sample_does_not_fire() -> None:
    assert feed(CardState("c"), [10000, 10000, 16000, 10000, 10000, 16300, 10000]) == [None] * 7


def test_a_step_spread_over_two_samples_is_not_missed() -> None:
    fired = feed(CardState("c"), [10000, 10000, 10700, 11400, 11400, 11400], total=14000)
    assert any(f and "step +1,400 MiB" in f for f in fired)


def test_a_step_seen_by_a_late_monitor_still_fires() -> None:
    """The monitor fell behind (a busy proxy on a loaded machine): the step's reading came
    0.4 s after the one before, past the 0.25 s window. A climb that took longer than
    late_s (1 s by default) is no step."""
    state = CardState("c")
    assert state.observe(reading(10000, 0.0), LINES) is None
    assert state.observe(reading(15041, 0.4), LINES) is None  # awaiting confirmation
    crossing = state.observe(reading(15041, 0.403), LINES)
    assert crossing is not None and crossing.line == "step +5,041 MiB, 1,343 MiB left"
    slow = CardState("c")
    assert [slow.observe(reading(v, t), LINES) for v, t in ((10000, 0), (15041, 1.5))] == [None] * 2
    assert slow.observe(reading(15041, 1.503), LINES) is None and slow.armed


def test_a_step_with_plenty_left_is_not_pressure() -> None:
    assert feed(CardState("c"), [1000, 1000, 3000, 3000, 3000]) == [None] * 5


def test_a_card_filling_up_fires_and_rearms_only_when_clearly_below() -> None:
    state = CardState("c")
    assert feed(state, [10000, 15900, 15900])[2] == "484 MiB free (floor 512)"
    assert state.observe(reading(14900, 1.0), LINES) is None and not state.armed  # 1,484 free
    state.observe(reading(14800, 1.1), LINES)  # 1,584 free: over floor + 1,024
    assert state.armed and state.clear_since == 1.1
    assert state.observe(reading(15900, 1.2), LINES) is None
    crossing = state.observe(reading(15900, 1.22), LINES)
    assert crossing == Crossing("c", "484 MiB free (floor 512)", 1.2, 1.22, 1.1)


def test_a_card_full_at_rest_is_not_pressure_but_memory_taken_from_it_is() -> None:
    """A model sized to fill its card: 328 MiB free at rest, under the 512 MiB floor. It
    stays armed, dead flat; another process taking half of that fires it, and it is clear
    again once three quarters of what was taken is back."""
    state = CardState("c")
    assert feed(state, [16056] * 20) == [None] * 20 and state.armed and state.rest_free == 328
    assert LINES.acts_at(16384, state.rest_free) == 164
    assert state.observe(reading(16100, 1.0), LINES) is None  # 284 free: 44 taken
    assert state.observe(reading(16230, 1.1), LINES) is None  # 154 free: awaiting confirmation
    crossing = state.observe(reading(16230, 1.12), LINES)
    assert crossing is not None and crossing.line == "154 MiB free (floor 164)"
    state.observe(reading(16100, 1.2), LINES)  # 284 free: only a quarter back
    assert not state.armed
    state.observe(reading(16060, 1.3), LINES)  # 324 free: back
    assert state.armed


def test_a_card_filled_while_its_server_loads_is_clear_once_it_is_up() -> None:
    """The proxy started before its primary: the model loading filled the card (fired,
    with no answer on it to move); the server coming up settles the card at its new rest."""
    state = CardState("c")
    fired = feed(state, [800] * 3 + [8000, 12000, 16000, 16056, 16056])
    assert any(fired) and not state.armed
    assert not state.settle(since=10.0)  # fired before the server went down: pressure stays
    assert state.settle(since=0.05) and state.armed and state.rest_free == 328
    assert state.pressed(now=100.0, dwell_s=30) is None  # no dwell: it is its own model
    assert state.observe(reading(16060, 1.0), LINES) is None and state.armed


def test_a_failed_reading_breaks_a_confirmation() -> None:
    state = CardState("c")
    feed(state, [15700])
    state.fail("read error")
    assert state.observe(reading(15700, 0.04), LINES) is None and state.error is None


def test_hotplug_events_rescan_and_sample(tmp_path: Path) -> None:
    """Events go through the same handler the pyudev observer calls (no udev daemon here)."""
    FakeCard(tmp_path, "card0", total_mib=8192, used_mib=1000)
    source = SysfsVramSource(tmp_path)
    monitor = MemoryMonitor([source], lambda *a: None, LINES)
    events = HotplugEvents(monitor.rescan, monitor.sample)
    monitor.sample()
    assert set(monitor.cards) == {"drm:card0"}
    FakeCard(tmp_path, "card1", total_mib=8192, used_mib=2000)
    events.handle("drm", "add", "card1", {})
    assert set(monitor.cards) == {"drm:card0", "drm:card1"}
    events.handle("drm", "add", "card1-HDMI-A-1", {})  # connector: ignored
    events.handle("pci", "add", "0000:00:1f.3", {"DRIVER": "snd_hda_intel", "PCI_CLASS": "40300"})
    assert dict(events.handled) == {"drm add": 1}

    shutil.rmtree(tmp_path / "class/drm/card1")
    events.handle("drm", "remove", "card1", {})
    assert set(monitor.cards) == {"drm:card0"}
    samples = monitor.samples
    events.handle("drm", "change", "card0", {})
    assert monitor.samples == samples + 1


def test_an_nvidia_card_is_followed_as_a_pci_device() -> None:
    """An NVIDIA card without DRM nodes announces itself only on the PCI bus: a display-class
    device, or one bound to a GPU driver, makes every source look again."""
    rescans = []
    events = HotplugEvents(lambda: rescans.append(1), lambda: None)
    events.handle("pci", "add", "0000:17:00.0", {"DRIVER": "nvidia", "PCI_CLASS": "30200"})
    events.handle("pci", "remove", "0000:17:00.0", {"PCI_CLASS": "30200"})  # driver gone
    events.handle("pci", "bind", "0000:18:00.0", {"DRIVER": "nvidia"})
    events.handle("usb", "add", "1-1", {"DRIVER": "nvidia"})
    assert len(rescans) == 3
    assert dict(events.handled) == {"pci add": 1, "pci remove": 1, "pci bind": 1}


def test_the_doctor_says_which_card_changes_are_signalled(tmp_path: Path) -> None:
    devices = tmp_path / "bus/pci/devices"
    drivers = tmp_path / "bus/pci/drivers"
    for address, pci_class, driver, drm in (
        ("0000:17:00.0", "0x030200", "nvidia", False),
        ("0000:03:00.0", "0x030000", "amdgpu", True),
        ("0000:00:1f.3", "0x040300", "snd_hda_intel", False),
    ):
        (devices / address).mkdir(parents=True)
        (devices / address / "class").write_text(pci_class + "\n")
        (drivers / driver).mkdir(parents=True, exist_ok=True)
        (devices / address / "driver").symlink_to(drivers / driver)
        if drm:
            (devices / address / "drm" / "card0").mkdir(parents=True)
    cards = pci_cards(tmp_path)
    assert [(c.address, c.driver, c.drm) for c in cards] == [
        ("0000:03:00.0", "amdgpu", True),
        ("0000:17:00.0", "nvidia", False),
    ]
    said = what_is_seen(cards, "udev events unavailable (no netlink)")
    assert said == ["no hotplug events (udev events unavailable (no netlink)); "
                    "a card added later needs a restart"]  # fmt: skip
    try:
        observer = UdevObserver(HotplugEvents(lambda: None, lambda: None))
    except NotApplicable:
        return
    said = "\n".join(what_is_seen(cards, observer))
    assert "0000:17:00.0 (nvidia): added/removed seen as a PCI device only" in said
    assert "0000:03:00.0 (amdgpu): added/removed seen (pci, drm)" in said


def test_udev_at_its_boundary() -> None:
    """The real pyudev: where this machine offers no netlink monitor it must say so; where
    it does, the observer starts and stops (events themselves are tested above)."""
    events = HotplugEvents(lambda: None, lambda: None)
    try:
        observer = UdevObserver(events)
    except NotApplicable as exc:
        assert "udev events unavailable" in str(exc)
        return
    assert observer.source == ("udev" if Path("/run/udev/control").exists() else "kernel")
    observer.start()
    observer.stop()


def test_card_map_parsing() -> None:
    assert parse_card_map(" http://a:1/=nvml:0+nvml:1 , http://b:2=ram") == {
        "http://a:1": {"nvml:0", "nvml:1"},
        "http://b:2": {"ram"},
    }
    with pytest.raises(ValueError, match="URL=card"):
        parse_card_map("http://a:1")


def test_the_kernels_listening_sockets_are_the_ones_proc_lists() -> None:
    """sock_diag (asked where /proc is this machine's) against /proc/net/tcp{,6}, read as
    they were before it, on real sockets: IPv4 and IPv6 listening, one connected."""
    with contextlib.ExitStack() as stack:
        listening = [stack.enter_context(socket.create_server(("127.0.0.1", 0)))]
        with contextlib.suppress(OSError):  # (a machine without IPv6 on its loopback)
            six = socket.create_server(("::1", 0), family=socket.AF_INET6)
            listening.append(stack.enter_context(six))
        stack.enter_context(socket.create_connection(listening[0].getsockname()[:2]))
        ours = {sock.getsockname()[1]: os.fstat(sock.fileno()).st_ino for sock in listening}
        mine = {(port, os.getuid(), inode) for port, inode in ours.items()}
        assert mine <= set(listed(Path("/proc")))
        for port in ours:
            assert os.getpid() in find_listeners(port).pids
            # The same /proc by another name is read as files, as a test tree is.
            assert find_listeners(port) == find_listeners(port, Path("/proc/self/.."))
        asked = sockdiag.listening()
        if asked is None:  # (the product reads /proc/net/tcp then, checked above)
            pytest.skip("the kernel refuses netlink sock_diag here")
        assert mine <= set(asked)
        assert sorted(asked) == sorted(listed(Path("/proc")))


def test_a_stale_card_mapping_is_looked_up_again_while_the_known_one_serves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The proxy asks for a server's cards on its event loop, for each answer; the lookup
    walks every process's descriptors, so a stale mapping is looked up again elsewhere."""
    monkeypatch.setattr(gates, "REFRESH_SECONDS", 0.0)
    answering, holding = threading.Event(), {}

    def gpu_pids() -> dict[int, set[str]]:
        answering.wait(30)
        return dict(holding)

    answering.set()
    with listening_process() as (pid, port):
        server = f"http://127.0.0.1:{port}"
        card_map = CardMap({}, gpu_pids)
        assert card_map.mapping_of(server).how == IN_RAM
        answering.clear()  # the server takes a card; its next lookup hangs until told
        holding[pid] = {"nvml:1"}
        asked = time.monotonic()
        assert card_map.mapping_of(server).how == IN_RAM  # the mapping known, at once
        assert time.monotonic() - asked < 1
        answering.set()
        deadline = time.monotonic() + 10
        while card_map.mapping_of(server).cards != {"nvml:1"}:
            assert time.monotonic() < deadline, "the lookup never landed"
            time.sleep(0.01)


def test_a_card_lookup_that_fails_keeps_the_known_mapping_until_its_next_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a thread, a failed lookup is logged and the known mapping serves on: it is not
    asked again on every answer (a thread and a traceback each) before REFRESH_SECONDS."""
    monkeypatch.setattr(gates, "REFRESH_SECONDS", 0.5)
    asked: list[float] = []

    def gpu_pids() -> dict[int, set[str]]:
        asked.append(time.monotonic())
        if len(asked) > 1:
            raise RuntimeError("the driver went away")
        return {}

    with listening_process() as (_, port):
        server = f"http://127.0.0.1:{port}"
        card_map = CardMap({}, gpu_pids)
        assert card_map.mapping_of(server).how == IN_RAM
        time.sleep(0.6)
        until = time.monotonic() + 0.3
        while time.monotonic() < until:
            assert card_map.mapping_of(server).how == IN_RAM
            time.sleep(0.01)
        assert len(asked) == 2, asked  # the first lookup, and one failed refresh


def test_gates_find_a_local_server_by_its_port() -> None:
    with listening_process() as (pid, port):
        assert pid in listening_pids(port)
        mapping = CardMap({}, dict).mapping_of(f"http://127.0.0.1:{port}")
        assert (mapping.cards, mapping.how) == ({"ram"}, IN_RAM)  # no GPU device: system RAM
        gpu = CardMap({}, lambda: {pid: {"nvml:1"}})
        assert gpu.servers_on(
            "nvml:1", [f"http://127.0.0.1:{port}", "http://gpu-box.invalid:8081"]
        ) == {f"http://127.0.0.1:{port}"}
    assert CardMap({"http://gpu-box.invalid:8081": {"nvml:0"}}, dict).cards_of(
        "http://gpu-box.invalid:8081/"
    ) == {"nvml:0"}
    assert CardMap({}, dict).cards_of("http://gpu-box.invalid:8081") == set()
