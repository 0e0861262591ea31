"""The doctor reports what it finds on real files and a real server."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from scripts.doctor import CGROUP_ROOT, cgroup2_mount
from scripts.parts import cardorder
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.memfiles import FakeCard, write_meminfo

REPO = Path(__file__).resolve().parent.parent


def test_doctor_reports_sources_cards_and_servers(primary: LlamaServer, tmp_path: Path) -> None:
    sysfs, proc = tmp_path / "sys", tmp_path / "proc"
    FakeCard(sysfs, "card0", total_mib=16384, used_mib=10000)
    FakeCard(sysfs, "card1", total_mib=8192, used_mib=7864)  # full at rest: half of it taken
    write_meminfo(proc / "meminfo", total_mib=24000, available_mib=20000)
    done = subprocess.run(
        [
            sys.executable, "-m", "scripts.doctor", "--sysfs-root", str(sysfs),
            "--proc-root", str(proc), "--servers", f"{primary.url},http://127.0.0.1:9",
            "--cards", f"{primary.url}=drm:card0,http://127.0.0.1:9=cuda:1",
        ],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    out = done.stdout
    # A card named that no source reports: marked, as the proxy would refuse to start.
    assert "--  spillover_cards: http://127.0.0.1:9=cuda:1: no card 'cuda:1' here;" in out
    assert "spillover_cards names a card that is not here" in out.splitlines()[-1]
    # A server that does not answer stops the protection: said last, and the status is 1.
    assert done.returncode == 1, done.stderr
    assert out.endswith(
        "\nwhat stops the protection: spillover_cards names a card that is not here; "
        "http://127.0.0.1:9 (see servers)\n"
    )
    assert "ok  sysfs: 2 card(s)" in out
    assert (
        "drm:card0: 10,000 of 16,384 MiB used, 6,384 free; hands off on free <= 512 MiB or "
        "a step of +1,024 MiB leaving <= 2,560"
    ) in out
    assert (
        "drm:card1: 7,864 of 8,192 MiB used, 328 free; hands off on free <= 164 MiB or a step "
        "of +1,024 MiB leaving <= 2,212 (full at rest: 328 MiB free, under twice its 512 MiB "
        "floor, so half of that taken)"
    ) in out
    assert "ram: 4,000 of 24,000 MiB used, 20,000 free; hands off on free <= 720 MiB" in out
    assert "\nhotplug\n" in out and "no display-class PCI device here" in out
    assert "--  nvml: NVML unavailable" in out or "ok  nvml" in out
    assert (
        f"ok  {primary.url}: llama-server, primary.gguf, 1024 ctx/slot; cards: drm:card0 "
        "(by explicit: spillover_cards)"
    ) in out
    assert "--  http://127.0.0.1:9: answers neither /props nor /v1/models; is it running?" in out
    assert (
        f"ok  {primary.url}: llama-server; continues an answer, asked by a trailing "
        "assistant message: a trailing assistant message renders what the model saw" in out
    )
    assert "--  http://127.0.0.1:9: openai-compatible; continues no answer that sent text" in out


def doctor(*args: str, status: int = 0) -> str:
    """What the doctor says, where it exits with `status` (1: the protection stops)."""
    run = [sys.executable, "-m", "scripts.doctor", *args]
    done = subprocess.run(run, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == status, done.stdout + done.stderr
    return done.stdout


def test_doctor_warns_of_small_fallback_slots_and_names_a_proxy(
    start_server, start_proxy, primary: LlamaServer
) -> None:
    small = start_server("fallback", ctx_size=1024, slots=4)  # 256 tokens per slot
    proxy = start_proxy(primary.url, [small.url])
    out = doctor("--servers", f"{primary.url},{small.url},{proxy.url}", status=1)
    assert (
        f"WARNING: {small.url} has 256 tokens per slot, fewer than the primary's 1024: an "
        "answer cut late does not fit there"
    ) in out
    assert f"--  {proxy.url}: a spillover proxy, not a server: give the servers behind it" in out
    assert "none given" in doctor("--sysfs-root", "/nonexistent")


def test_the_cgroup_v2_hierarchy_is_found_where_it_is_mounted(tmp_path: Path) -> None:
    """(Where mitmproxy's local capture looks for it, and the doctor with it.)"""
    mounts = tmp_path / "mounts"
    hybrid = (
        "cgroup /sys/fs/cgroup/cpu cgroup rw 0 0\ncgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n"
    )
    for text, found in (
        (hybrid, "/sys/fs/cgroup/unified"),
        ("cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid 0 0\n", CGROUP_ROOT),
        ("proc /proc proc rw 0 0\n", None),
    ):
        mounts.write_text(text)
        assert cgroup2_mount(mounts) == found


def test_nvml_and_cuda_numbers_are_matched_by_pci_bus() -> None:
    """Two cards, CUDA numbering the faster (on bus 0x65) first, as its default order
    does, and a third hidden from CUDA (CUDA_VISIBLE_DEVICES): NVML's ids as nvidia-ml-py
    writes them, CUDA's as cuDeviceGetPCIBusId does."""
    nvml = ["00000000:17:00.0", "00000000:65:00.0", "00000000:B3:00.0"]
    cuda = ["0000:65:00.0", "0000:17:00.0"]
    assert cardorder.cuda_indexes(nvml, cuda) == {0: 1, 1: 0}
    assert cardorder.normal("00000000:b3:00.0") == cardorder.normal("0000:B3:00.0")
    assert cardorder.normal("not a bus id") is None
    assert cardorder.cuda_indexes(nvml, ["0000:17:00.0", "0000:65:00.0"]) == {0: 0, 1: 1}


class Loading(BaseHTTPRequestHandler):
    """What llama-server answers to every route while it loads its model (a stand-in: a
    real one loads the test models too fast to be caught at it)."""

    def do_GET(self) -> None:
        said = b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(said)))
        self.end_headers()
        self.wfile.write(said)

    do_POST = do_GET

    def log_message(self, *args: object) -> None:
        pass


def test_a_server_still_loading_is_told_apart_from_one_not_running() -> None:
    loading = ThreadingHTTPServer(("127.0.0.1", 0), Loading)
    threading.Thread(target=loading.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{loading.server_address[1]}"
    try:
        out = doctor("--servers", f"{url},http://127.0.0.1:9", status=1)
    finally:
        loading.shutdown()
    assert f"--  {url}: answers neither /props nor /v1/models, though its port is held: " in out
    assert "still loading its model?" in out and f"pid {os.getpid()} (" in out
    assert "--  http://127.0.0.1:9: answers neither /props nor /v1/models; is it running?" in out
