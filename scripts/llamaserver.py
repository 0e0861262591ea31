"""Real llama-server processes on free loopback ports (tests, demo, benchmarks)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from scripts.processes import ManagedProcess, ServerFailed, running

__all__ = ["LlamaServer", "ServerFailed", "running"]


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
    ) -> None:
        super().__init__(port, log_dir)
        self.model = model
        self.binary = binary
        self.args = [
            "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port),
            "--ctx-size", str(ctx_size), "--parallel", str(slots), "--threads", str(threads),
            "--device", "none", "--n-gpu-layers", "0", "--metrics", *extra_args,
        ]  # fmt: skip

    def argv(self) -> list[str]:
        if self.binary is None:
            from scripts.llamabin import find_binary

            self.binary = find_binary()
        return [str(self.binary), *self.args]
