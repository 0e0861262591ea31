"""Real llama-server processes on free loopback ports (tests, demo, benchmarks), and the
binary they run: the first candidate (`llamabin.candidates`) that runs on this CPU.

    python -m scripts.testbed.llamaserver    # print the binary, building it if needed
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from scripts.parts.processes import ManagedProcess, ServerFailed, running
from scripts.testbed.llamabin import (
    BUILD_VARIANTS,
    BinaryNotFound,
    build_from_source,
    candidates,
)
from scripts.testbed.trial import EngineUnusable, file_identity, first_build_that_runs, verdict

__all__ = [
    "BinaryNotFound", "LlamaRouter", "LlamaServer", "ServerFailed", "find_binary", "running",
]  # fmt: skip


class LlamaServer(ManagedProcess):
    """One llama-server serving one model on the CPU."""

    name = "llama-server"

    def __init__(
        self,
        model: Path,
        *,
        binary: Path | None = None,
        port: int | None = None,
        ctx_size: int = 4096,
        slots: int = 4,
        threads: int = 1,
        extra_args: Sequence[str] = (),
        log_dir: Path | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        super().__init__(port, log_dir, host)
        self.model = model
        self.binary = binary
        self.args = [
            "--model", str(model), "--host", host, "--port", str(self.port),
            "--ctx-size", str(ctx_size), "--parallel", str(slots), "--threads", str(threads),
            "--device", "none", "--n-gpu-layers", "0", "--metrics", *extra_args,
        ]  # fmt: skip

    def argv(self) -> list[str]:
        if self.binary is None:
            self.binary = find_binary()
        return [str(self.binary), *self.args]


class LlamaRouter(LlamaServer):
    """llama-server in router mode: each GGUF file in `directory` is a model of its own,
    named by its file's stem, loaded when a request names it."""

    name = "llama-router"

    def __init__(self, directory: Path, **kwargs) -> None:
        super().__init__(directory, **kwargs)
        at = self.args.index("--model")
        self.args[at : at + 2] = ["--models-dir", str(directory)]


def find_binary() -> Path:
    for binary, needs_trial in candidates():
        if not needs_trial or runs_here(binary):
            return binary
    raise BinaryNotFound(
        "no llama-server that runs on this CPU: run scripts/setup.sh (it builds one), "
        "or point LLAMA_SERVER at your own build"
    )


def runs_here(binary: Path) -> bool:
    return why_not_here(binary) is None


def why_not_here(binary: Path) -> str | None:
    """None when the binary loads a tiny model and writes a few tokens; else why (asked
    once per binary and CPU)."""
    return verdict(
        "llama-server", file_identity(binary),
        lambda gguf: LlamaServer(gguf, binary=binary, ctx_size=256, slots=1),
    )  # fmt: skip


def ensure_binary() -> Path:
    """A llama-server that runs here, building one (native, else portable) if none does."""
    try:
        return find_binary()
    except BinaryNotFound:
        pass
    try:
        return first_build_that_runs(
            "llama-server", BUILD_VARIANTS, build_from_source, why_not_here
        )
    except EngineUnusable as exc:
        raise BinaryNotFound(str(exc)) from None


if __name__ == "__main__":
    print(ensure_binary())
