"""Which cards a server is on, and how that was found: port -> process -> NVML's or fdinfo's
process lists, else the device files it holds open, through trees of real files standing
in for /proc and /sys (and the real /proc for this test's own processes)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import stat
import time
from pathlib import Path

import pytest

from scripts.parts.summary import server_lines
from scripts.testbed.memfiles import FakeCard, FakeProcess, add_listening_socket, drm_node
from tests.listener import listening_process
from watchers import gates
from watchers.devices import DeviceCards, DeviceFile, open_devices
from watchers.fdinfo import FdinfoSource
from watchers.gates import CardMap, Mapping, PidCards
from watchers.nvml import NvmlSource
from watchers.reading import NotApplicable
from watchers.sources import gpu_pids, nvml_minors

URL = "http://127.0.0.1:8081"
NVIDIA_CONTROL_FILES = (
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-modeset",
    "/dev/nvidia-caps/nvidia-cap1",
    "/dev/null",
)


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path]:
    proc, sysfs = tmp_path / "proc", tmp_path / "sys"
    (sysfs / "class" / "drm").mkdir(parents=True)
    return proc, sysfs


def server(proc: Path, port: int = 8081, pid: int = 4242, comm: str = "llama-server"):
    process = FakeProcess(proc, pid, comm)
    process.listen(port, inode=900000 + pid)
    return process


def card_map(proc: Path, sysfs: Path, minors: dict[int, str], held=None, explicit=None):
    return CardMap(
        explicit or {}, lambda: held or {}, proc, sysfs=sysfs, minors=lambda: dict(minors)
    )


def test_nvidia_device_file_names_its_card_by_minor(roots: tuple[Path, Path]) -> None:
    proc, sysfs = roots
    process = server(proc)
    for path in NVIDIA_CONTROL_FILES:
        process.open(path)
    process.open("/dev/nvidia1")
    # minor 1 is NVML's card 0: a mapping that took the minor for the index would say nvml:1
    cards = card_map(proc, sysfs, {0: "nvml:1", 1: "nvml:0"})
    mapping = cards.mapping_of(URL + "/")
    assert mapping.cards == {"nvml:0"} and mapping.how == gates.DEVICE_FILES
    assert mapping.pids == (4242,)
    assert "/dev/nvidia1 -> nvml:0" in mapping.detail and "llama-server" in mapping.detail
    assert "nvidiactl" not in mapping.detail and "uvm" not in mapping.detail
    assert "cap" not in mapping.detail and "modeset" not in mapping.detail
    assert "every card it can see" not in mapping.detail  # one card: nothing to over-count
    assert cards.cards_of(URL) == {"nvml:0"}
    assert cards.servers_on("nvml:0", [URL, "http://gpu-box.invalid:8081"]) == {URL}
    assert cards.servers_on("nvml:1", [URL]) == set()


def test_control_files_alone_mean_system_ram(roots: tuple[Path, Path]) -> None:
    proc, sysfs = roots
    process = server(proc)
    for path in NVIDIA_CONTROL_FILES:
        process.open(path)
    mapping = card_map(proc, sysfs, {0: "nvml:0"}).mapping_of(URL)
    assert mapping.cards == {"ram"} and mapping.how == gates.IN_RAM
    assert "no GPU device open by pid 4242 (llama-server)" in mapping.detail


def test_every_nvidia_card_open_is_said_to_be_an_over_approximation(
    roots: tuple[Path, Path],
) -> None:
    proc, sysfs = roots
    process = server(proc)
    for minor in (0, 1, 3):
        process.open(f"/dev/nvidia{minor}")
    mapping = card_map(proc, sysfs, {0: "nvml:0", 1: "nvml:1"}).mapping_of(URL)
    assert mapping.cards == {"nvml:0", "nvml:1"} and mapping.how == gates.DEVICE_FILES
    assert "every card it can see" in mapping.detail and "CUDA_VISIBLE_DEVICES" in mapping.detail
    assert "/dev/nvidia3: no NVML card has minor 3" in mapping.detail


def test_a_device_no_source_names_is_not_mistaken_for_ram(roots: tuple[Path, Path]) -> None:
    """Without NVML (no minors) /dev/nvidia0 names no card we can read: no cards, not ram."""
    proc, sysfs = roots
    server(proc).open("/dev/nvidia0")
    mapping = card_map(proc, sysfs, {}).mapping_of(URL)
    assert mapping.cards == set() and mapping.how == gates.DEVICE_FILES
    assert "no NVML card has minor 0" in str(mapping)


def test_render_node_maps_to_its_drm_card_through_sysfs(roots: tuple[Path, Path]) -> None:
    proc, sysfs = roots
    card0 = FakeCard(sysfs, "card0", total_mib=8192, used_mib=0, pdev="0000:03:00.0")
    card1 = FakeCard(sysfs, "card1", total_mib=16384, used_mib=0, pdev="0000:04:00.0")
    # renderD128 belongs to card1 and renderD129 to card0: numbers do not pair up by order
    drm_node(sysfs, "renderD128", card1.device)
    drm_node(sysfs, "renderD129", card0.device)
    server(proc).open("/dev/dri/renderD128")
    server(proc, 8082, 4343).open("/dev/dri/card0")
    cards = card_map(proc, sysfs, {})
    mapping = cards.mapping_of(URL)
    assert mapping.cards == {"drm:card1"} and mapping.how == gates.DEVICE_FILES
    assert "/dev/dri/renderD128 -> drm:card1" in mapping.detail
    assert cards.cards_of("http://localhost:8082") == {"drm:card0"}


def test_an_nvidia_cards_drm_node_adds_no_second_card(roots: tuple[Path, Path]) -> None:
    proc, sysfs = roots
    pci = sysfs / "devices" / "0000:65:00.0"
    pci.mkdir(parents=True)
    drm_node(sysfs, "card2", pci, driver="nvidia")
    drm_node(sysfs, "renderD130", pci)
    process = server(proc)
    process.open("/dev/dri/renderD130")
    process.open("/dev/nvidia0")
    mapping = card_map(proc, sysfs, {0: "nvml:0"}).mapping_of(URL)
    assert mapping.cards == {"nvml:0"}
    assert "renderD130: an NVIDIA card's DRM node" in mapping.detail


def test_nvml_process_list_wins_when_it_names_the_pid(roots: tuple[Path, Path]) -> None:
    proc, sysfs = roots
    process = server(proc)
    process.open("/dev/nvidia0")
    process.open("/dev/nvidia1")
    held = PidCards()
    held.add(4242, {"nvml:1"}, gates.NVML_PROCESSES)
    held.add(77, {"nvml:0"}, gates.NVML_PROCESSES)  # someone else
    mapping = card_map(proc, sysfs, {0: "nvml:0", 1: "nvml:1"}, held).mapping_of(URL)
    assert mapping.cards == {"nvml:1"} and mapping.how == "nvml processes"
    assert mapping.detail == "pid 4242 (llama-server) on nvml:1"
    # a plain pid -> cards list (older callers) still wins, saying less about where from
    plain = card_map(proc, sysfs, {0: "nvml:0"}, {4242: {"nvml:1"}}).mapping_of(URL)
    assert plain.cards == {"nvml:1"} and plain.how == gates.PROCESS_LIST


def test_the_processes_a_server_started_are_followed_to_their_cards(
    roots: tuple[Path, Path],
) -> None:
    """vLLM answers HTTP from its API server; EngineCore and its Worker, started by it,
    hold the card."""
    proc, sysfs = roots
    api = server(proc, comm="python3")
    engine, worker = FakeProcess(proc, 4300, "EngineCore"), FakeProcess(proc, 4301, "Worker")
    api.start(engine)
    engine.start(worker)
    held = PidCards()
    held.add(4301, {"nvml:1"}, gates.NVML_PROCESSES)
    mapping = card_map(proc, sysfs, {1: "nvml:1"}, held).mapping_of(URL)
    assert mapping.cards == {"nvml:1"} and mapping.how == "nvml processes"
    assert mapping.pids == (4242, 4300, 4301)
    assert "pid 4301 (Worker)" in mapping.detail


def test_fdinfo_pids_win_through_the_real_sources(roots: tuple[Path, Path]) -> None:
    proc, sysfs = roots
    card = FakeCard(sysfs, "card0", total_mib=8192, used_mib=0, pdev="0000:03:00.0")
    drm_node(sysfs, "renderD128", card.device)
    other = FakeCard(sysfs, "card1", total_mib=8192, used_mib=0, pdev="0000:04:00.0")
    drm_node(sysfs, "renderD129", other.device)
    process = server(proc)
    process.open("/dev/dri/renderD129")  # open, but holding nothing there
    fd = process.open("/dev/dri/renderD128")
    (process.dir / "fdinfo").mkdir()
    (process.dir / "fdinfo" / fd.name).write_text(
        "pos:\t0\ndrm-driver:\txe\ndrm-pdev:\t0000:03:00.0\ndrm-client-id:\t7\n"
        "drm-resident-vram0:\t2097152 KiB\n"
    )
    source = FdinfoSource(proc, sysfs)
    source.read()
    cards = CardMap({}, lambda: gpu_pids([source]), proc, sysfs=sysfs)
    mapping = cards.mapping_of(URL)
    assert mapping.cards == {"drm:card0"} and mapping.how == gates.DRM_FDINFO


def test_a_mapping_made_before_fdinfo_has_read_is_looked_up_again_soon(
    roots: tuple[Path, Path],
) -> None:
    """The proxy may be asked for a server's cards before the monitor's first sample: the
    mapping made then cannot know whose memory fdinfo counts, and is looked up again a
    second later, not REFRESH_SECONDS later."""
    proc, sysfs = roots
    card = FakeCard(sysfs, "card0", total_mib=8192, used_mib=0, pdev="0000:03:00.0")
    drm_node(sysfs, "renderD128", card.device)
    fd = server(proc).open("/dev/dri/renderD128")
    (proc / "4242" / "fdinfo").mkdir()
    (proc / "4242" / "fdinfo" / fd.name).write_text(
        "pos:\t0\ndrm-driver:\tamdgpu\ndrm-pdev:\t0000:03:00.0\ndrm-client-id:\t7\n"
        "drm-resident-vram:\t2097152 KiB\n"
    )
    source = FdinfoSource(proc, sysfs)
    cards = CardMap({}, lambda: gpu_pids([source]), proc, sysfs=sysfs)
    early = cards.mapping_of(URL)
    assert not early.settled and early.how != gates.DRM_FDINFO
    assert early.status()["settled"] is False
    source.read()
    deadline = time.monotonic() + gates.SOON_SECONDS + 2
    while (mapping := cards.mapping_of(URL)).how != gates.DRM_FDINFO:
        assert time.monotonic() < deadline, mapping
        time.sleep(0.05)
    assert mapping.cards == {"drm:card0"} and mapping.settled and mapping.status()["settled"]
    # `spillover status` says which of the two a server's cards are.
    said = [
        server_lines({"routing": {"states": {URL: {"state": "ok"}}},
                      "memory": {"servers": {URL: made.status()}}})[1]
        for made in (early, mapping)
    ]  # fmt: skip
    assert "(a GPU source had not read yet: looked up again within a second)" in said[0]
    assert "cards: drm:card0; 0 answers live" in said[1], said[1]


def test_one_model_over_two_cards_is_found_on_both(roots: tuple[Path, Path]) -> None:
    """llama-server with --tensor-split holds memory on both cards: NVML lists its pid on
    each (and a CUDA process holds both device files), and fdinfo counts it on each."""
    proc, sysfs = roots
    process = server(proc)
    process.open("/dev/nvidia0")
    process.open("/dev/nvidia1")
    held = PidCards()
    held.add(4242, {"nvml:0"}, gates.NVML_PROCESSES)
    held.add(4242, {"nvml:1"}, gates.NVML_PROCESSES)
    mapping = card_map(proc, sysfs, {0: "nvml:0", 1: "nvml:1"}, held).mapping_of(URL)
    assert mapping.cards == {"nvml:0", "nvml:1"} and mapping.how == "nvml processes"
    # The same through DRM fdinfo (amdgpu, Intel): memory resident on both render nodes.
    proc2, sysfs2 = roots[0].parent / "proc2", roots[1].parent / "sys2"
    twice = server(proc2)
    (twice.dir / "fdinfo").mkdir()
    for n, pdev in ((0, "0000:03:00.0"), (1, "0000:04:00.0")):
        card = FakeCard(sysfs2, f"card{n}", total_mib=24576, used_mib=0, pdev=pdev)
        drm_node(sysfs2, f"renderD{128 + n}", card.device)
        fd = twice.open(f"/dev/dri/renderD{128 + n}")
        (twice.dir / "fdinfo" / fd.name).write_text(
            f"pos:\t0\ndrm-driver:\tamdgpu\ndrm-pdev:\t{pdev}\ndrm-client-id:\t{n + 7}\n"
            "drm-memory-vram:\t12582912 KiB\n"
        )
    source = FdinfoSource(proc2, sysfs2)
    source.read()
    found = CardMap({}, lambda: gpu_pids([source]), proc2, sysfs=sysfs2).mapping_of(URL)
    assert found.cards == {"drm:card0", "drm:card1"} and found.how == gates.DRM_FDINFO


def test_nvml_sources_give_labelled_pids_and_minors() -> None:
    class Nvml(NvmlSource):  # the glue only: the real NVML is tested at its boundary
        def __init__(self) -> None:
            pass

        def processes(self) -> dict[int, set[str]]:
            return {10: {"nvml:0"}}

        def minor_numbers(self) -> dict[int, str]:
            return {3: "nvml:0"}

    held = gpu_pids([Nvml()])
    assert held == {10: {"nvml:0"}} and held.how == {10: {gates.NVML_PROCESSES}}
    assert nvml_minors([Nvml()]) == {3: "nvml:0"}


def test_nvml_minor_numbers_at_their_boundary() -> None:
    try:
        nvml = NvmlSource()
    except NotApplicable as exc:
        pytest.skip(f"no NVML here: {exc}")
    minors = nvml.minor_numbers()
    assert set(minors.values()) <= {f"nvml:{i}" for i in range(len(nvml.handles))}
    for minor in minors:
        assert Path(f"/dev/nvidia{minor}").exists()


def test_explicit_wins_and_remote_servers_say_so(roots: tuple[Path, Path]) -> None:
    proc, sysfs = roots
    server(proc).open("/dev/nvidia0")
    explicit = {URL: {"nvml:5"}}
    held = {4242: {"nvml:0"}}
    cards = card_map(proc, sysfs, {0: "nvml:0"}, held, explicit)
    assert cards.mapping_of(URL + "/") == Mapping(
        frozenset({"nvml:5"}), "explicit", "spillover_cards"
    )
    remote = cards.mapping_of("http://gpu-box.invalid:8081")
    assert remote.cards == set() and remote.how == gates.REMOTE
    assert "gpu-box.invalid is not this machine" in remote.detail
    assert "spillover_cards" in remote.detail


def test_nobody_listening_unseen_and_forwarded_ports(roots: tuple[Path, Path]) -> None:
    proc, sysfs = roots
    server(proc)
    add_listening_socket(proc, 8083, inode=55)  # a socket no visible process holds
    server(proc, 8084, 5000, comm="docker-proxy").open("/dev/null")
    cards = card_map(proc, sysfs, {})
    nobody = cards.mapping_of("http://127.0.0.1:8089")
    assert nobody.how == gates.NOT_LISTENING and "port 8089" in nobody.detail
    unseen = cards.mapping_of("http://127.0.0.1:8083")
    assert unseen.how == gates.UNSEEN and unseen.cards == set()
    forwarded = cards.mapping_of("http://127.0.0.1:8084")
    assert forwarded.how == gates.FORWARDED and forwarded.cards == set()
    assert "docker-proxy" in forwarded.detail and forwarded.pids == (5000,)
    assert cards.mapping_of(URL).how == gates.IN_RAM  # the same tree's plain server


def test_a_url_without_a_port_is_looked_for_on_its_schemes_own(roots: tuple[Path, Path]) -> None:
    """https://localhost is port 443, http://localhost port 80: the card map and the
    processes the watcher leaves out of the rest both look there."""
    proc, sysfs = roots
    server(proc, 443, 4242).open("/dev/null")
    server(proc, 80, 5000, comm="vllm")
    cards = card_map(proc, sysfs, {})
    assert cards.mapping_of("https://localhost").pids == (4242,)
    assert cards.mapping_of("http://localhost").pids == (5000,)
    assert cards.server_pids(["https://127.0.0.1"]) == {4242}
    assert cards.server_pids(["http://127.0.0.1/v1"]) == {5000}


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a mode-000 directory anyway")
def test_unreadable_descriptors_say_permission_in_a_tree(roots: tuple[Path, Path]) -> None:
    proc, sysfs = roots
    process = FakeProcess(proc, 4242)
    process.listen(8081, inode=77, uid=os.getuid())
    process.open("/dev/nvidia0")
    (process.dir / "fd").chmod(0)
    try:
        mapping = card_map(proc, sysfs, {0: "nvml:0"}).mapping_of(URL)
    finally:
        (process.dir / "fd").chmod(stat.S_IRWXU)
    assert mapping.how == gates.PERMISSION and mapping.cards == set() and mapping.pids == (4242,)
    assert f"cannot read {proc}/4242/fd (permission denied" in mapping.detail


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another user")
def test_another_users_server_says_permission_on_the_real_proc() -> None:
    """The real case: this (root) process listens; a child that became `nobody` cannot read
    its descriptors, and must say so rather than call the server unlisted or in RAM."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        read_end, write_end = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the child
            try:
                listener.close()  # else the child itself would hold the socket
                os.setgid(65534)
                os.setuid(65534)
                mapping = CardMap({}, dict).mapping_of(f"http://127.0.0.1:{port}")
                os.write(write_end, json.dumps(mapping.status()).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        # fork() in a threaded process can leave the child stuck on a lock another thread
        # held: never wait on it for ever.
        ready, _, _ = select.select([read_end], [], [], 10)
        if not ready:
            os.kill(child, signal.SIGKILL)
        with os.fdopen(read_end) as pipe:
            answer = pipe.read() if ready else ""
        os.waitpid(child, 0)
        assert answer, "the child process answered nothing within 10 s"
    status = json.loads(answer)
    assert status["how"] == gates.PERMISSION and status["cards"] == []
    assert os.getpid() in status["pids"] and "permission denied" in status["detail"]


def test_a_real_process_on_no_gpu_is_in_ram() -> None:
    """A process listening, read through the real /proc: no GPU device open there."""
    with listening_process() as (pid, port):
        mapping = CardMap({}, dict, minors=lambda: {0: "nvml:0"}).mapping_of(
            f"http://127.0.0.1:{port}"
        )
    assert mapping.cards == {"ram"} and mapping.how == gates.IN_RAM
    assert mapping.pids == (pid,) and f"pid {pid} (python" in mapping.detail


def test_device_numbers_decide_over_names(tmp_path: Path) -> None:
    """Real character device nodes (made here, never opened): a container may name
    195:1 /dev/nvidia0 and 226:129 renderD128; stat of the descriptor tells the truth."""
    dev = tmp_path / "dev"
    (dev / "dri").mkdir(parents=True)
    try:
        os.mknod(dev / "nvidia0", stat.S_IFCHR | 0o600, os.makedev(195, 1))
        os.mknod(dev / "nvidiactl", stat.S_IFCHR | 0o600, os.makedev(195, 255))
        os.mknod(dev / "dri" / "renderD128", stat.S_IFCHR | 0o600, os.makedev(226, 129))
    except PermissionError:
        pytest.skip("cannot make device nodes here (needs CAP_MKNOD)")
    sysfs, proc = tmp_path / "sys", tmp_path / "proc"
    card0 = FakeCard(sysfs, "card0", total_mib=8192, used_mib=0, pdev="0000:03:00.0")
    card1 = FakeCard(sysfs, "card1", total_mib=8192, used_mib=0, pdev="0000:04:00.0")
    drm_node(sysfs, "renderD128", card0.device)
    drm_node(sysfs, "renderD129", card1.device)
    process = FakeProcess(proc, 4242)
    for name in ("nvidia0", "nvidiactl", "dri/renderD128"):
        process.open(dev / name)
    devices = open_devices(4242, proc, dev=str(dev))
    assert sorted(d.rdev for d in devices) == [(195, 1), (195, 255), (226, 129)]
    resolver = DeviceCards({0: "nvml:0", 1: "nvml:1"}, sysfs, dev=str(dev))
    found = [resolver.identify(d) for d in devices]
    assert sorted(f.card for f in found if f is not None) == ["drm:card1", "nvml:1"]
    # without a device number (a dangling link) the name is all there is
    assert resolver.identify(DeviceFile(f"{dev}/nvidia0", None)).card == "nvml:0"
    assert resolver.identify(DeviceFile("/dev/nvidia0", (1, 3))) is None  # /dev/null, renamed
