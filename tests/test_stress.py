"""`scripts.stress` makes real memory pressure a person can watch a handoff with."""

from __future__ import annotations

import ctypes.util
import os
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


@pytest.fixture(scope="module")
def cuda_standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder whose libcuda.so.1 is tests/cudastandin.c: no machine the suite runs on
    has a card with a few hundred MiB free on demand (the stand-in says how much)."""
    folder = tmp_path_factory.mktemp("cuda")
    built = subprocess.run(
        ["cc", "-shared", "-fPIC", "-o", folder / "libcuda.so.1", REPO / "tests/cudastandin.c"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    return folder


def stress_on_card(standin: Path, free_mib: int, *args: str, context_mib: int = 0):
    env = {**os.environ, "LD_LIBRARY_PATH": str(standin), "CUDA_STANDIN_FREE_MIB": str(free_mib),
           "CUDA_STANDIN_CONTEXT_MIB": str(context_mib)}  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "scripts.stress", "gpu", "--card", "cuda:0", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_a_step_larger_than_the_card_has_free_is_sized_to_it(cuda_standin: Path) -> None:
    """The documented `--step-mib 4096` on a card with 500 MiB free takes what is free
    less --leave-mib, and says so; a second step finds no room and says why."""
    ran = stress_on_card(cuda_standin, 500, "--step-mib", "4096", "--steps", "2", "--hold-s", "0",
                         "--every-s", "0")  # fmt: skip
    assert ran.returncode == 0 and ran.stderr == "", ran.stderr
    assert ran.stdout.splitlines() == [
        "card: cuda:0 (PCI 0000:17:00.0)",
        "before: card 0: 500 of 24,576 MiB free",
        "step 1: 4,096 MiB asked, the card has 500 free: taking 436 (--leave-mib 64 left free)",
        "step 1: took 436 MiB (436 in all); card 0: 64 of 24,576 MiB free",
        "step 2: the card has 64 MiB free and 64 are left free (--leave-mib): no room for a step",
        "holding 436 MiB for 0 s",
        "gave back 436 MiB; card 0: 500 of 24,576 MiB free",
    ]


def test_a_card_with_no_room_says_why_in_one_line(cuda_standin: Path) -> None:
    ran = stress_on_card(cuda_standin, 40, "--step-mib", "4096", "--hold-s", "0")
    assert ran.returncode == 1 and "Traceback" not in ran.stderr, ran.stderr
    assert "step 1: the card has 40 MiB free and 64 are left free (--leave-mib): no room " \
        "for a step\ngave back 0 MiB" in ran.stdout  # fmt: skip
    context = stress_on_card(cuda_standin, 200, "--hold-s", "0", context_mib=300)
    assert context.returncode == 2 and "Traceback" not in context.stderr
    assert context.stderr == (
        "stress: cuDevicePrimaryCtxRetain failed: CUDA_ERROR_OUT_OF_MEMORY (2): the card has "
        "not that much free\n"
    )


def test_the_card_is_the_settings_files_primarys(cuda_standin: Path, tmp_path: Path) -> None:
    """`stress gpu --config FILE` without --card takes the card the file gives its
    primary; a key the file should not hold is refused in one line before anything."""
    config = tmp_path / "spillover.yaml"
    config.write_text("primary: http://127.0.0.1:8081\ncards: http://127.0.0.1:8081=nvml:1\n")
    env = {**os.environ, "LD_LIBRARY_PATH": str(cuda_standin)}
    run = [sys.executable, "-m", "scripts.stress", "gpu", "--hold-s", "0"]
    ran = subprocess.run([*run, "--config", str(config)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert ran.stdout.splitlines()[0] == "the primary http://127.0.0.1:8081 is on nvml:1 (explicit)"
    assert ran.returncode == 2 and ran.stderr.startswith("stress: nvml:1"), ran.stderr
    config.write_text("primary: http://127.0.0.1:8081\nstep_mb: 4096\n")
    ran = subprocess.run(run, cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert ran.returncode == 2 and ran.stdout == "", ran.stdout
    assert ran.stderr == (
        f"stress: settings from {config}\n"
        "stress: spillover.yaml: unknown key step_mb; did you mean step_mib?\n"
    )
