"""Benchmark: the handoff pause with KV migration against replay, side by side.

Real llama-servers on the generated 6 x 384 model, the same model on both sides, saving
slots into one directory. At prompts of about 512, 2,048 and 7,000 tokens, a streaming
answer is handed off (asked for while the primary streams on) through a proxy that
migrates (`spillover_slot_dir`) and through one that replays token ids; the fallback's
slots are erased before each run, so replay reads everything again. Prints the pause a
client sees (its last text before the handoff to its first after), the migration's own
time (finding the slot, saving, restoring), save and restore as the servers report them,
the saved state's size, and the ratio of the pauses.

    .venv/bin/python -m scripts.bench.migration [--quick]
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from scripts.bench.shadow import CONTROL, body, erase, prompt_of
from scripts.parts.processes import running
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.mitm import Mitmdump
from scripts.testbed.tinymodels import BENCH_PRESETS, ensure_model

CONTEXTS = (512, 2048, 7000)
CUT = 32  # chunks before the handoff is asked for
QUIET = [
    "spillover_shadow=off", "spillover_stall_s=0", "spillover_slow_percent=0",
    "spillover_health_s=0",
]  # fmt: skip
MOVED = re.compile(r"moved (\d+) tokens' KV state in (\d+) ms")


def one_handoff(proxy: Mitmdump, text: str) -> dict:
    note = None
    note_at = first_after = last_before = None
    chunks = 0
    with httpx.stream(
        "POST", f"{proxy.url}/v1/chat/completions", json=body(text, 200), timeout=300
    ) as r:
        for line in r.iter_lines():
            if line.startswith(": spillover: handoff"):
                note, note_at = line, time.perf_counter()
            elif line.startswith("data: {"):
                chunks += 1
                if note_at is None:
                    last_before = time.perf_counter()
                elif first_after is None and '"content"' in line:
                    first_after = time.perf_counter()
                if chunks == CUT:
                    CONTROL.post(f"{proxy.url}/spillover/handoff")
    if note is None or last_before is None or first_after is None:
        raise RuntimeError("no handoff happened")
    moved = CONTROL.get(f"{proxy.url}/spillover/status").json()["migration"]["last"]
    # The client's gap: its last text before the handoff to its first after (the note
    # is written once the continuation is ready, so after a migration).
    return {"pause_ms": (first_after - last_before) * 1000, "note": note, "moved": moved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run per cell")
    args = parser.parse_args()
    repeats = 1 if args.quick else 3
    work = Path(tempfile.mkdtemp(prefix="spillover-bench-migration-"))
    slots = work / "slots"
    slots.mkdir()
    model = ensure_model(Path("models"), "medium", BENCH_PRESETS["medium"])
    context = 2 * (max(CONTEXTS) + 800)
    saves = ["--slot-save-path", str(slots)]
    primary = LlamaServer(model, ctx_size=context, slots=2, log_dir=work, extra_args=saves)
    fallback = LlamaServer(model, ctx_size=context, slots=2, log_dir=work, extra_args=saves)
    with running(primary, fallback):
        migrating = Mitmdump(
            primary.url, [fallback.url], options=[*QUIET, f"spillover_slot_dir={slots}"],
            log_dir=work,
        )  # fmt: skip
        replaying = Mitmdump(primary.url, [fallback.url], options=QUIET, log_dir=work)
        with running(migrating, replaying):
            migrating.servers_known()
            replaying.servers_known()
            print(
                f"{'context':>8} {'replay ms':>10} {'migrate ms':>11} {'moving ms':>10}"
                f" {'find ms':>8} {'save ms':>8} {'restore ms':>11} {'MiB':>6} {'ratio':>6}"
            )
            for size in CONTEXTS:
                text = prompt_of(size, primary)
                runs: dict[str, list[dict]] = {"replay": [], "migrate": []}
                for _ in range(repeats):
                    for name, proxy in (("replay", replaying), ("migrate", migrating)):
                        erase(fallback)
                        runs[name].append(one_handoff(proxy, text))
                replay = statistics.median(r["pause_ms"] for r in runs["replay"])
                migrate = statistics.median(r["pause_ms"] for r in runs["migrate"])
                for run in runs["migrate"]:
                    if MOVED.search(run["note"]) is None:
                        raise RuntimeError(f"not migrated: {run['note']}")
                moved = [r["moved"] for r in runs["migrate"]]
                took, find, save, restore, mib = (
                    statistics.median(m[key] for m in moved) / scale
                    for key, scale in (
                        ("took_ms", 1), ("find_ms", 1), ("save_ms", 1), ("restore_ms", 1),
                        ("size", 2**20),
                    )
                )  # fmt: skip
                print(
                    f"{size:8,} {replay:10.1f} {migrate:11.1f} {took:10.1f} {find:8.1f}"
                    f" {save:8.1f} {restore:11.1f} {mib:6.1f} {migrate / replay:6.3f}"
                )
    leftover = list(slots.glob("spillover-*"))
    print(f"slot files left behind: {len(leftover)}")


if __name__ == "__main__":
    main()
