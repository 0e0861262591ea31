"""The `spillover` command: `run` starts a working proxy without the addon's path, and
each tool answers under it (a real mitmdump, real llama-servers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from scripts.testbed.processes import ManagedProcess
from tests.streams import assert_one_clean_stream, chat_body, read_stream

REPO = Path(__file__).resolve().parent.parent


class SpilloverRun(ManagedProcess):
    name = "spillover-run"
    health_path = "/spillover/status"

    def __init__(self, primary: str, fallbacks: str, log_dir: Path) -> None:
        super().__init__(None, log_dir)
        self.primary, self.fallbacks = primary, fallbacks

    def argv(self) -> list[str]:
        return [
            sys.executable, "-m", "scripts.cli", "run", "--primary", self.primary,
            "--fallbacks", self.fallbacks, "--port", str(self.port), "--", "--set",
            "flow_detail=0",
        ]  # fmt: skip


def spillover(*args: str) -> subprocess.CompletedProcess[str]:
    run = [sys.executable, "-m", "scripts.cli", *args]
    return subprocess.run(run, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_run_starts_the_proxy_in_front_of_the_primary(
    start_server, fallback, server_logs: Path
) -> None:
    primary = start_server("primary")
    proxy = SpilloverRun(primary.url, fallback.url, server_logs).start(timeout=60)
    try:
        stream = read_stream(
            proxy.url, chat_body(200), on_chunk=lambda n: n == 30 and primary.kill()
        )
        assert_one_clean_stream(stream)
        assert f"{primary.url} -> {fallback.url}" in stream.notes[0]
        said = spillover("status", "--proxy", proxy.url)
        assert said.returncode == 0 and json.loads(said.stdout)["fallbacks"] == [fallback.url]
    finally:
        proxy.stop()
    assert f"listening at 127.0.0.1:{proxy.port}" in proxy.log_path.read_text()


def test_every_command_has_help_and_a_mistake_is_named() -> None:
    for command in ("run", "status", "doctor", "watch", "stress", "services", "guard"):
        said = spillover(command, "--help")
        assert said.returncode == 0 and "usage: spillover" in said.stdout, (command, said.stderr)
    wrong = spillover("run", "--primary", "http://127.0.0.1:9", "--fallback", "x")
    assert wrong.returncode == 2 and "unknown arguments --fallback x" in wrong.stderr
    nobody = spillover("status", "--proxy", "http://127.0.0.1:9")
    assert nobody.returncode == 1 and "no proxy at http://127.0.0.1:9" in nobody.stderr
