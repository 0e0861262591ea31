"""The GPU proof's pause phase (scripts/gpu/realrun.py, scripts/gpu/pauses.py) rehearsed
on the CPU: real llama-servers on a small model of Llama 3's geometry, one mitmdump with
the addon per way of handing off (re-read, shadow prefill, KV migration), a handoff
asked mid-answer in each, and the table the proof prints."""

from __future__ import annotations

import time
from pathlib import Path

from scripts.gpu.pauses import NAMES
from scripts.gpu.realrun import phase_pauses
from scripts.gpu.stats import Summary
from scripts.gpu.testbed import llama_server, start_all
from scripts.testbed import geometry
from scripts.testbed.llamacppfiles import folder, vocab
from scripts.testbed.llamaserver import find_binary
from tests.throttle import Throttled

LENGTH, ANSWER, CUT = 400, 160, 16


def test_each_way_of_handing_off_is_timed_and_tabled(tmp_path: Path) -> None:
    template = folder() / "templates" / "meta-llama-Llama-3.1-8B-Instruct.jinja"
    vocabulary = geometry.Vocabulary.read(vocab("llama-bpe"), template.read_text())
    model = geometry.ensure(tmp_path / "models", "tiny", vocabulary)
    slots = tmp_path / "slots"
    slots.mkdir()
    saves = ["--slot-save-path", str(slots)]
    servers = [
        llama_server(model, find_binary(), tmp_path, gpu=None, ctx_size=4096, extra_args=saves)
        for _ in range(3)
    ]
    primary, small, twin = servers
    summary = Summary()
    try:
        start_all(servers, timeout=60)
        # paced as on a slow card: the answer still streams when the shadow has caught up
        with Throttled(primary.pid, run_s=0.004, period_s=0.02):
            phase_pauses(
                summary, primary, {"small": small, "twin": twin}, slots, tmp_path,
                time.monotonic() + 240, ((LENGTH,), ANSWER, CUT), rounds=1,
            )  # fmt: skip
    finally:
        for server in servers:
            server.stop()
    assert "errors" not in summary.extra
    cells = summary.extra["pauses"]
    assert [(c["length"], c["setup"], c["errors"], len(c["runs"])) for c in cells] == [
        (LENGTH, name, [], 1) for name in NAMES
    ]
    for cell in cells:
        (run,) = cell["runs"]
        assert "requested by POST /spillover/handoff" in run["note"]
        # The note comes first; with the text after it, where both were written in one
        # pass, in the same read (0 ms).
        assert 0 <= run["note_to_text_ms"] <= run["pause_ms"]
        assert cell["pause_ms"] == {
            "n": 1,
            **{k: round(run["pause_ms"], 1) for k in ("min", "median", "max")},
        }
    assert "tokens' KV state" in cells[2]["runs"][0]["note"]  # migrated, not re-read
    said = summary.extra["pause_table"].splitlines()
    assert said[0].startswith("handoff pause, ms: min / median / max (runs); primary geometry-tiny")
    assert said[1].split() == ["tokens", "re-read", "shadow", "prefill", "KV", "migration"]
    assert said[2].startswith(f"{LENGTH:>8}") and said[2].count("(1)") == 3
    assert not list(slots.glob("spillover-*"))  # the migration's slot files are gone
