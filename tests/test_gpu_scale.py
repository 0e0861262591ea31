"""The workers-at-scale command a lent GPU machine runs (scripts/gpu/scale.py), rehearsed
here at a small size: HAProxy from Debian's packages as the bundle carries them (fetched
with `apt-get download`, unpacked into a folder, run with its own libraries by a
wrapper, nothing installed), mitmdump beside a link to this Python, and the paced
bench's rows with a row of workers behind that HAProxy."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.gpu.scale import PACKAGES, bundled_haproxy

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("apt-get") is None:
        pytest.skip("no apt-get here to fetch HAProxy's Debian packages")
    folder = tmp_path_factory.mktemp("bundle")
    fetched = subprocess.run(
        ["apt-get", "download", "-q", *PACKAGES], cwd=folder, capture_output=True, text=True
    )
    if fetched.returncode != 0:
        pytest.skip(f"apt-get download failed: {fetched.stderr.strip()[-300:]}")
    return folder


def test_the_bundles_haproxy_runs_from_its_packages_unpacked(bundle: Path, tmp_path: Path) -> None:
    """Its libraries are the unpacked ones, not the system's (which a GPU machine lacks)."""
    wrapper = bundled_haproxy(bundle, tmp_path)
    said = subprocess.run(
        [wrapper, "-v"], capture_output=True, text=True, check=True,
        env={**os.environ, "LD_DEBUG": "libs"},
    )  # fmt: skip
    assert said.stdout.startswith("HAProxy version 2.")
    libraries = wrapper.parent / "usr/lib/x86_64-linux-gnu"
    for name in ("liblua5.3.so.0", "libopentracing-c-wrapper.so.0", "libopentracing.so.1"):
        assert f"calling init: {libraries / name}" in said.stderr, name


def test_the_scale_command_measures_workers_behind_the_bundles_haproxy(
    bundle: Path, tmp_path: Path
) -> None:
    argv = [sys.executable, "-m", "scripts.gpu.scale", "--wheels", str(bundle),
            "--bundled-haproxy", "--streams", "16", "--workers", "2", "--seconds", "1"]  # fmt: skip
    ran = subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OUT": str(tmp_path)},
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert re.search(r"^scale: HAProxy \S+/haproxy-haproxy_[^/]+/haproxy;", ran.stdout, re.M)
    row = re.search(r"^\s+16\s+workers 2\s+(\d+)\s+(\d+)", ran.stdout, re.M)
    assert row is not None, ran.stdout
    asked, got = map(int, row.groups())
    assert asked == 16 * 40 and got > asked / 2, ran.stdout
    assert (tmp_path / "scale.txt").read_text() in ran.stdout
