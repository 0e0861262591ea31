"""The GPU proof's loop rehearsed on the CPU: the same plan, ballast, steps, give-back,
re-arm and readiness code (scripts/gpu/loop.py) and the same memory helper
(scripts/gpu/hog.py) as on a real card, with a sysfs-tree card standing in for the GPU
and real llama-servers, a real mitmdump with the addon, several handoffs in one run."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from scripts.gpu.hog import MIB, Hog
from scripts.gpu.loop import Settings, steps_on_card, wait_ready
from scripts.gpu.stats import Summary
from scripts.gpu.testbed import ProofBed, llama_server
from scripts.testbed.llamaserver import find_binary
from scripts.testbed.memfiles import FakeCard
from scripts.testbed.mitm import watch_sysfs
from tests.throttle import Throttled

IDLE_MIB = 2000


def used_mib(card: FakeCard) -> float:
    return int((card.device / "mem_info_vram_used").read_text()) / MIB


def test_the_helper_gives_a_step_back_to_the_card(tmp_path: Path) -> None:
    """The step is held by nothing but the helper's list: freed, it leaves the card (the
    proof's first GPU run kept it in a local of the serving loop, and stopped there)."""
    card = FakeCard(tmp_path / "sys", "card0", total_mib=16384, used_mib=IDLE_MIB)
    hog = Hog.file_card(card.device / "mem_info_vram_used", tmp_path / "hog.log")
    try:
        assert hog.reply(timeout=30)["ready"]
        assert hog.read() == (IDLE_MIB, 16384)
        hog.ask(op="alloc", what="ballast", mib=8000)
        taken = hog.ask(op="alloc", what="step", mib=5000)
        assert used_mib(card) == IDLE_MIB + 13000
        assert taken["t0"] <= taken["t1"] <= taken["nvml_seen"]
        hog.ask(op="free", what="step")
        assert used_mib(card) == IDLE_MIB + 8000
        hog.ask(op="alloc", what="step", mib=5000)
        hog.ask(op="free", what="step")
        assert used_mib(card) == IDLE_MIB + 8000
        hog.ask(op="free", what="ballast")
        assert used_mib(card) == IDLE_MIB
        with pytest.raises(RuntimeError, match="unknown op"):
            hog.ask(op="grow")
    finally:
        hog.close()


def test_the_proofs_loop_hands_off_and_re_arms_run_after_run(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    card = FakeCard(sysfs, "card0", total_mib=16384, used_mib=IDLE_MIB)
    FakeCard(sysfs, "card1", total_mib=8192, used_mib=1000)
    from scripts.testbed.tinymodels import ensure_models

    models = ensure_models(tmp_path / "models")
    binary = find_binary()
    primary = llama_server(models["primary"], binary, tmp_path, gpu=None)
    fallback = llama_server(models["fallback"], binary, tmp_path, gpu=None)
    on = {primary.url: "drm:card0", fallback.url: "drm:card1"}
    options = ["spillover_dwell_s=1", *watch_sysfs(sysfs, on)]
    summary = Summary()
    settings = Settings(after_chunks=20, max_tokens=600, most=3, card_kind="drm:")
    with ProofBed(primary, [fallback], tmp_path, options) as bed:
        hog = Hog.file_card(card.device / "mem_info_vram_used", tmp_path / "hog.log")
        try:
            assert hog.reply(timeout=30)["ready"]
            # the primary paced as on a slow card: the answer is still being written when
            # the step comes at the client's 20th chunk, however loaded this machine is
            with Throttled(primary.pid):
                runs = steps_on_card(bed, hog, settings, summary, time.monotonic() + 240)
            log = bed.proxy.log_tail(60)
            assert summary.extra["errors"] == [] and runs is not None, log
            plan = summary.extra["plan"]
            assert plan["ballast_mib"] == [16384 - IDLE_MIB - 6144] and plan["step_mib"] == 5120
            assert plan["step_fires"] and plan["rearms"]
            assert [(r.clean, r.why) for r in summary.runs] == [(True, "")] * 3, log
            for result in summary.runs:
                assert "memory pressure on drm:card0" in (result.note or "")
                assert result.alloc_done is not None and result.note_at is not None
                assert result.alloc_done < result.note_at < (result.fallback_at or 0)
            assert used_mib(card) == 16384 - 6144  # every step given back, the ballast kept
            # each run waited for the card to re-arm; after the last it re-arms too
            assert wait_ready(bed.status, runs.card, primary.url, time.monotonic() + 10) is None
            assert bed.status()["memory"]["cards"]["drm:card0"]["fired"] == 3

            # a step no run gives back: the wait gives up and says what it saw
            hog.ask(op="alloc", what="step", mib=5120)
            deadline = time.monotonic() + 10
            while bed.status()["memory"]["cards"]["drm:card0"]["fired"] < 4:
                assert time.monotonic() < deadline, bed.status()["memory"]
                time.sleep(0.02)
            waited = wait_ready(bed.status, runs.card, primary.url, time.monotonic() + 1.5)
        finally:
            hog.close()
    assert waited is not None
    assert f"waited for drm:card0 armed, {primary.url} ok and no live answer" in waited
    assert "drm:card0: 15,360 of 16,384 MiB used (1,024 free" in waited
    assert "armed False, fired 4" in waited
    assert f"{primary.url} pressured (drm:card0: " in waited and "live answers: 0" in waited
