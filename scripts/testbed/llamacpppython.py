"""llama-cpp-python's OpenAI-compatible server, another engine on the same GGUF files.

Built once from its sdist into a virtual environment of its own under the cache (about
4.5 min on 2 cores; CMake and a C++ compiler needed) and trusted once it has written a few
tokens on a tiny model (the native build, else a portable one: trial.py), then started
like llama-server on a free loopback port. Its chat route opens a new turn after a
trailing assistant message (../shared/FACTS.md section 6): the engine the addon must never
ask to continue one.

    python -m scripts.testbed.llamacpppython    # build it if needed; print its python
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from scripts.parts.processes import ManagedProcess
from scripts.testbed.llamabin import BUILD_VARIANTS, CACHE, cpu_key
from scripts.testbed.trial import file_identity, first_build_that_runs, verdict

PACKAGE = "llama-cpp-python[server]==0.3.36"
# No wheel cache: pip keys a built wheel by the sdist alone, so a later variant would get
# the first one's build whatever CMAKE_ARGS says (seen: three variants, one native wheel).
PIP_FLAGS = ("--disable-pip-version-check", "--no-cache-dir")
BUILD_FLAGS = (
    "-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
)  # fmt: skip


def venv(variant: str) -> Path:
    return CACHE / f"llama-cpp-python-0.3.36-{variant}-{cpu_key()}"


def ensure_python() -> Path:
    """The python of a virtual environment whose server generates here: the native build,
    else a portable one (each built once, then tried on a tiny model)."""
    return first_build_that_runs("llama-cpp-python", BUILD_VARIANTS, _build, why_not_here)


def _build(variant: str) -> Path:
    python = venv(variant) / "bin" / "python"
    done = venv(variant) / ".installed"
    if done.exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv(variant))], check=True)
    print(f"llama-cpp-python: building {PACKAGE}, {variant} (once, about 5 min)", file=sys.stderr)
    flags = " ".join((*BUILD_FLAGS, *BUILD_VARIANTS[variant]))
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", *PIP_FLAGS, PACKAGE],
        check=True,
        env={**os.environ, "CMAKE_ARGS": flags, "FORCE_CMAKE": "1"},
    )
    done.write_text(PACKAGE)
    return python


def why_not_here(python: Path) -> str | None:
    """None when this build's server loads a tiny model and writes a few tokens."""
    installed = file_identity(python.parent.parent / ".installed")
    return verdict(
        "llama-cpp-python", installed,
        lambda gguf: LlamaCppPythonServer(gguf, python=python), timeout=120,
    )  # fmt: skip


class LlamaCppPythonServer(ManagedProcess):
    """`python -m llama_cpp.server` serving one GGUF on the CPU."""

    name = "llama-cpp-python"
    health_path = "/v1/models"  # it has no /health

    def __init__(
        self,
        model: Path,
        *,
        ctx_size: int = 4096,
        log_dir: Path | None = None,
        python: Path | None = None,
    ) -> None:
        super().__init__(None, log_dir)
        self.model = model
        self.ctx_size = ctx_size
        self.python = python

    def argv(self) -> list[str]:
        return [
            str(self.python or ensure_python()), "-m", "llama_cpp.server",
            "--model", str(self.model),
            "--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", str(self.ctx_size),
            "--n_threads", "1", "--verbose", "false",
        ]  # fmt: skip


if __name__ == "__main__":
    print(ensure_python())
