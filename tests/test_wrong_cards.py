"""A card named wrong is refused at start with one line, not watched never: the real
mitmdump with the addon, a sysfs tree with two cards, and the mistakes people make."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from scripts.parts.processes import free_port
from scripts.testbed.memfiles import FakeCard
from scripts.testbed.mitm import ADDON, REPO
from watchers.cardids import unknown_cards

SERVER = "http://127.0.0.1:8081"


def start(cards: str, sysfs: Path) -> subprocess.CompletedProcess[str]:
    mitmdump = REPO / ".venv" / "bin" / "mitmdump"
    return subprocess.run(
        [
            str(mitmdump), "-s", str(ADDON), "--mode",
            f"reverse:{SERVER}@127.0.0.1:{free_port()}",
            "--set", f"spillover_sysfs_root={sysfs}", "--set", "spillover_sources=sysfs",
            "--set", f"spillover_cards={cards}",
        ],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip


@pytest.fixture(scope="module")
def sysfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sys")
    FakeCard(root, "card0", total_mib=24576, used_mib=24000)
    FakeCard(root, "card1", total_mib=24576, used_mib=1000)
    return root


@pytest.mark.parametrize(
    ("cards", "said"),
    [
        (
            f"{SERVER}=cuda:0",
            f"spillover_cards: {SERVER}=cuda:0: no card 'cuda:0' here; cards are named by "
            "their source, NVIDIA ones as NVML numbers them (nvml:N, by PCI bus, not CUDA's "
            "fastest-first order: `spillover doctor` says which nvml:N is CUDA 0) (cards "
            "here: drm:card0, drm:card1)",
        ),
        (
            f"{SERVER}=1",
            f"spillover_cards: {SERVER}=1: no card '1' here; did you mean drm:card1? (cards "
            "here: drm:card0, drm:card1)",
        ),
        (
            f"{SERVER}=drm:card0+drm:card2",
            f"spillover_cards: {SERVER}=drm:card2: no card 'drm:card2' here (cards here: "
            "drm:card0, drm:card1)",
        ),
        (
            "0,1",
            "spillover_cards entry '0' is not URL=card[+card...] (e.g. http://127.0.0.1:8081="
            "nvml:0+nvml:1,http://127.0.0.1:8082=ram; `spillover doctor` lists the cards here)",
        ),
    ],
    ids=["cuda", "bare number", "one of two", "no server"],
)
def test_a_wrong_card_is_refused_in_one_line(cards: str, said: str, sysfs: Path) -> None:
    run = start(cards, sysfs)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert f"spillover: {said}\n" in out
    assert "Traceback" not in out


def test_cards_that_exist_are_taken(sysfs: Path) -> None:
    """The same check passes a right mapping (a model over both cards) and remote cards,
    which only Prometheus can show."""
    named = {SERVER: {"drm:card0", "drm:card1"}, "http://10.0.0.2:8082": {"prom:gpu2:0"}}
    assert unknown_cards(named, {"drm:card0", "drm:card1"}) == []
