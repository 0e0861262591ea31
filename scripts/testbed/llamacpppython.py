"""llama-cpp-python's OpenAI-compatible server, another engine on the same GGUF files.

Built once from its sdist into a virtual environment of its own under the cache (about
4.5 min on 2 cores; CMake and a C++ compiler needed), then started like llama-server on a
free loopback port. Its chat route opens a new turn after a trailing assistant message
(../shared/FACTS.md section 6): the engine the addon must never ask to continue one.

    python -m scripts.testbed.llamacpppython    # build it if needed; print its python
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from scripts.testbed.llamabin import CACHE, cpu_key
from scripts.testbed.processes import ManagedProcess

PACKAGE = "llama-cpp-python[server]==0.3.36"
BUILD_FLAGS = (
    "-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
    "-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
)


def venv() -> Path:
    return CACHE / f"llama-cpp-python-0.3.36-{cpu_key()}"


def ensure_python() -> Path:
    """The python of a virtual environment with the server installed, built if needed."""
    python = venv() / "bin" / "python"
    done = venv() / ".installed"
    if done.exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv())], check=True)
    print(f"llama-cpp-python: building {PACKAGE} (once, about 5 min)", file=sys.stderr)
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", PACKAGE],
        check=True,
        env={**os.environ, "CMAKE_ARGS": BUILD_FLAGS, "FORCE_CMAKE": "1"},
    )
    done.write_text(PACKAGE)
    return python


class LlamaCppPythonServer(ManagedProcess):
    """`python -m llama_cpp.server` serving one GGUF on the CPU."""

    name = "llama-cpp-python"
    health_path = "/v1/models"  # it has no /health

    def __init__(self, model: Path, *, ctx_size: int = 4096, log_dir: Path | None = None) -> None:
        super().__init__(None, log_dir)
        self.model = model
        self.ctx_size = ctx_size

    def argv(self) -> list[str]:
        return [
            str(ensure_python()), "-m", "llama_cpp.server", "--model", str(self.model),
            "--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", str(self.ctx_size),
            "--n_threads", "1", "--verbose", "false",
        ]  # fmt: skip


if __name__ == "__main__":
    print(ensure_python())
