"""The GPU proof with models of real size (`python3.12 -m scripts.gpu.proof --geometry`):
on the card the 8B primary, an 8B twin (another process, for KV migration) and the 1B;
on the CPU another 1B (scripts/gpu/realsize.py makes them while llama-server builds).
Two phases, each within its share of the time:

1. the pauses (scripts/gpu/pauses.py): a handoff asked mid-answer at about 2k, 8k and 32k
   tokens of prompt + answer, re-read by the 1B on the card, with shadow prefill, and
   migrated 8B -> 8B;
2. pressure (scripts/gpu/loop.py, as the tiny proof): the ballast leaves the card at rest
   with room for one more 8B, then runs take turns: another llama-server loading the 8B
   onto the same card, and torch taking as much at once. The 1B on the card is passed
   over (a handoff never goes onto a card under pressure): answers go on on the CPU's.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from scripts.gpu.hog import Hog
from scripts.gpu.loop import Pressure, Runs, Settings, Step, prepare, repeat
from scripts.gpu.pauses import NAMES, Setup, measure, options, table
from scripts.gpu.realsize import (
    ANSWER,
    CUT,
    LENGTHS,
    Calibration,
    Loader,
    calibrate,
    decode_rate,
    nvml_free,
    slot_dir,
)
from scripts.gpu.stats import RunResult, Summary, handoff_ms_fields, parse_histogram
from scripts.gpu.testbed import ProofBed, llama_server, mitmdump, start_all

STEP_TOKENS = 160  # a step's answer: the CPU's 1B writes what is left after the handoff


def run(
    args: argparse.Namespace,
    summary: Summary,
    binary: Path,
    gpu: Any,
    work: Path,
    models: dict[str, Path],
    end: float,
    on_run: Callable[[RunResult], None],
) -> None:
    slots = slot_dir(work)
    context = 2 * (max(LENGTHS) + 1024)  # two slots, each the longest prompt and its answer
    saves = ["--slot-save-path", str(slots)]

    def on_card(model: Path, ctx: int = context, extra: tuple[str, ...] = tuple(saves)) -> Any:
        return llama_server(model, binary, work, gpu=gpu.uuid, ctx_size=ctx, extra_args=extra)

    primary, twin, small = on_card(models["8b"]), on_card(models["8b"]), on_card(models["1b"])
    threads = max(1, (os.cpu_count() or 2) // 2)
    cpu = llama_server(
        models["1b"], args.fallback_binary or binary, work, gpu=None, ctx_size=8192,
        threads=threads,
    )  # fmt: skip
    options_b = [f"spillover_dwell_s={args.dwell_s}"]
    with ProofBed(primary, [small, cpu], work, options_b) as bed:
        hog = Hog.cuda(gpu.index, gpu.uuid, work / "hog.log")  # its context is part of the rest
        try:
            start_all([twin], timeout=180)
            pauses_end = min(end - args.pressure_s, time.monotonic() + args.pauses_s)
            phase_pauses(summary, primary, {"small": small, "twin": twin}, slots, work, pauses_end)
            twin.stop()
            print(f"memory helper up on {hog.reply(timeout=180)['name']}")
            phase_pressure(args, summary, bed, hog, gpu, models, end, on_run, on_card)
        finally:
            hog.close()
            twin.stop()
        metrics = bed.metrics() if bed.proxy.process is not None else ""
        summary.detection = parse_histogram(metrics, "spillover_pressure_detection_seconds")
        summary.extra["metrics"] = [m for m in metrics.splitlines() if m.startswith("spillover_")]
    summary.handoff_ms_fields = handoff_ms_fields(bed.flows_metadata(summary))


def phase_pauses(
    summary: Summary,
    primary: Any,
    fallbacks: dict[str, Any],
    slots: Path,
    work: Path,
    end: float,
    shape: tuple[tuple[int, ...], int, int] = (LENGTHS, ANSWER, CUT),
    rounds: int = 3,
) -> None:
    """Phase 1: the pause table, at `shape`: (lengths, answer, cut)."""
    target = {name: fallbacks["twin" if name == "KV migration" else "small"] for name in NAMES}
    proxies = {
        name: mitmdump(primary, [target[name]], options(name, slots), work) for name in NAMES
    }
    try:
        start_all(list(proxies.values()), timeout=60)
        for proxy in proxies.values():
            proxy.servers_known(timeout=60)
        setups = [Setup(name, proxies[name], target[name]) for name in NAMES]
        lengths, answer, cut = shape
        cells = measure(setups, primary, list(lengths), answer, cut, end, rounds)
    except Exception as exc:  # the pressure phase goes on without the table
        summary.extra.setdefault("errors", []).append(f"pauses: {type(exc).__name__}: {exc}")
        return
    finally:
        for proxy in proxies.values():
            proxy.stop()
    summary.extra["pauses"] = [cell.as_json() for cell in cells]
    small = fallbacks["small"].model.name
    said = table(cells, f"primary {primary.model.name}; re-read by {small}; migrated to its twin")
    summary.extra["pause_table"] = said
    print("\n" + said)


def phase_pressure(
    args: argparse.Namespace,
    summary: Summary,
    bed: ProofBed,
    hog: Hog,
    gpu: Any,
    models: dict[str, Path],
    end: float,
    on_run: Callable[[RunResult], None],
    on_card: Callable[..., Any],
) -> None:
    """Phase 2: runs under a loading server and under torch's step, in turns (steps only
    where the loading server could not be measured)."""
    free = nvml_free(gpu.index)
    errors = summary.extra.setdefault("errors", [])

    def loader() -> Any:
        return on_card(models["8b"], 4096, ())

    try:
        calibration: Calibration | None = calibrate(loader, free)
        rate = decode_rate(bed.primary)
    except Exception as exc:  # the steps are still worth their runs
        errors.append(f"the loading server: {type(exc).__name__}: {exc}")
        calibration, rate = None, 0.0
    target = args.ballast_free_mib
    if calibration is not None:
        summary.extra["loader"] = {**asdict(calibration), "primary_decode_tok_s": round(rate, 1)}
        target = calibration.footprint_mib + args.after_free_mib
        print(
            f"another 8B loading takes {calibration.footprint_mib:,.0f} MiB, 90 % of it "
            f"{calibration.crossed_s:.1f} s after its launch; the primary writes {rate:.0f} "
            "tokens/s"
        )
    settings = Settings(
        target_free_mib=target, after_free_mib=args.after_free_mib, max_tokens=STEP_TOKENS,
        most=args.runs,
    )  # fmt: skip
    prepared = prepare(bed, hog, settings, summary, end)
    if prepared is None:
        return
    runs, step = prepared
    turns: list[tuple[Runs, Pressure]] = [(runs, Step(hog, step))]
    if calibration is not None:
        reading = bed.status()["memory"]["cards"][runs.card]
        # long enough to be still streaming when the load crosses the line, and some more
        tokens = int(runs.after_chunks + rate * (calibration.crossed_s + 2))
        pressure = Loader(loader, free, reading["floor_mib"], free())
        turns.insert(0, (replace(runs, max_tokens=tokens), pressure))
    while len(runs.results) < args.runs and time.monotonic() < end:
        for kind_runs, pressure in turns:
            if not repeat(kind_runs, pressure, end, 1, on_run):
                return
