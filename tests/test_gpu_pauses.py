"""The GPU proof's pause table (scripts/gpu/pauses.py) rehearsed on the CPU: real
llama-servers on a small model of Llama 3's geometry, one mitmdump with the addon per way
of handing off (re-read, shadow prefill, KV migration), a handoff asked mid-answer in
each, and the table the proof prints."""

from __future__ import annotations

import time
from pathlib import Path

from scripts.gpu.pauses import NAMES, Setup, measure, options, table
from scripts.gpu.testbed import llama_server, mitmdump, start_all
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
    proxies = {
        name: mitmdump(primary, [twin if name == "KV migration" else small],
                       options(name, slots), tmp_path)
        for name in NAMES
    }  # fmt: skip
    try:
        start_all(servers, timeout=60)
        start_all(list(proxies.values()), timeout=60)
        for proxy in proxies.values():
            proxy.servers_known()
        setups = [Setup(n, p, twin if n == "KV migration" else small) for n, p in proxies.items()]
        # paced as on a slow card: the answer still streams when the shadow has caught up
        with Throttled(primary.pid, run_s=0.004, period_s=0.02):
            cells = measure(setups, primary, [LENGTH], ANSWER, CUT, time.monotonic() + 240, 1)
    finally:
        for process in (*proxies.values(), *servers):
            process.stop()
    assert [(c.length, c.setup, c.errors, len(c.runs)) for c in cells] == [
        (LENGTH, name, [], 1) for name in NAMES
    ]
    for cell in cells:
        (run,) = cell.runs
        assert "requested by POST /spillover/handoff" in run["note"]
        assert 0 < run["note_to_text_ms"] <= run["pause_ms"]
    migrated = next(c for c in cells if c.setup == "KV migration").runs[0]["note"]
    assert "tokens' KV state" in migrated
    said = table(cells, "tiny geometry on the CPU").splitlines()
    assert said[0] == "handoff pause, ms: min / median / max (runs); tiny geometry on the CPU"
    assert said[1].split() == ["tokens", "re-read", "shadow", "prefill", "KV", "migration"]
    assert said[2].startswith(f"{LENGTH:>8}") and said[2].count("(1)") == 3
    assert not list(slots.glob("spillover-*"))  # the migration's slot files are gone
