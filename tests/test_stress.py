"""`scripts.stress` makes real memory pressure a person can watch a handoff with."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from scripts.testbed.memfiles import mem_available_mib
from scripts.testbed.mitm import REPO, ram_and_elsewhere
from tests.streams import assert_one_clean_stream, chat_body, read_stream


def stress(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "scripts.stress", *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.mark.alone
def test_taking_ram_in_steps_hands_off_an_answer_and_gives_it_back(
    start_server, start_proxy, tmp_path: Path
) -> None:
    """As a person would use it: the proxy watches system RAM with its line 400 MiB below
    what is free, and `stress ram` takes 2 x 500 MiB while an answer streams."""
    primary = start_server("primary", ctx_size=8192, slots=2)
    fallback = start_server("fallback", ctx_size=8192, slots=2)
    floor = int(mem_available_mib() - 400)
    options = [
        *ram_and_elsewhere(fallback.url, tmp_path / "sys"),
        f"spillover_free_floor_mib={floor}",
    ]
    proxy = start_proxy(primary.url, [fallback.url], options=options)
    assert httpx.get(f"{proxy.url}/spillover/status").json()["memory"]["servers"][primary.url][
        "cards"
    ] == ["ram"]
    started: list[subprocess.Popen[str]] = []

    def on_chunk(n: int) -> None:
        if n == 2:
            started.append(stress("ram", "--step-mib", "500", "--steps", "2", "--hold-s", "2"))

    stream = read_stream(proxy.url, chat_body(3000), on_chunk=on_chunk)
    (hog,) = started
    out, err = hog.communicate(timeout=60)
    assert hog.returncode == 0, err
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert "memory pressure on ram:" in note
    lines = out.splitlines()
    assert lines[0].startswith("before: ram: ") and lines[-1].startswith("gave back 1,000 MiB")
    assert "step 2: took 500 MiB (1,000 in all)" in out


@pytest.mark.skipif(
    ctypes.util.find_library("cuda") is not None, reason="a CUDA driver is here: it would allocate"
)
def test_without_a_cuda_driver_the_gpu_mode_says_so() -> None:
    for card in ("cuda:0", "nvml:0"):
        hog = stress("gpu", "--card", card, "--hold-s", "0")
        out, err = hog.communicate(timeout=30)
        assert hog.returncode == 2 and out == ""
        assert err.startswith("stress: no CUDA driver here (libcuda.so.1:")


def test_the_gpu_mode_takes_cards_as_spillover_cards_names_them() -> None:
    """A bare number is CUDA's on one tool and NVML's on another: it is refused."""
    hog = stress("gpu", "--card", "1", "--hold-s", "0")
    out, err = hog.communicate(timeout=30)
    assert hog.returncode == 2 and out == ""
    assert err == (
        "stress: '1': name an NVIDIA card as spillover_cards does (nvml:N; `spillover doctor` "
        "lists them) or by CUDA's number (cuda:N)\n"
    )
