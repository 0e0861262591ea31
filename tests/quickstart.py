"""Running a block of the docs as written: bash runs it from a temporary folder with the
commands it names found on PATH (the ones this machine has), and the proxy it starts on
8090 is waited for."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from addon.servers.routing import CALM

REPO = Path(__file__).resolve().parent.parent
PROXY = "http://127.0.0.1:8090"
QUICK_START_PORTS = (8081, 8082, 8090)


@contextmanager
def quick_start_ports(*more: int) -> Iterator[None]:
    """The ports the docs' blocks use (8081, 8082, 8090, and `more` a block also takes),
    held for one test: the tests that run a block wait for each other (they run in
    parallel workers); where another program holds one of the ports, the test is skipped."""
    with open(Path(tempfile.gettempdir()) / "spillover-quick-start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            for port in (*QUICK_START_PORTS, *more):
                with socket.socket() as probe:
                    if probe.connect_ex(("127.0.0.1", port)) == 0:
                        pytest.skip(f"port {port}, which the quick start uses, is taken here")
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def doc_block(page: str, heading: str) -> str:
    """The first shell block under `heading` (a regular expression) of `page`."""
    text = (REPO / page).read_text()
    block = re.search(rf"{heading}.*?```sh\n(.*?)```", text, re.S)
    assert block is not None, f"{page}: no shell block under {heading!r}"
    return block.group(1)


def your_models(block: str, **models: Path) -> str:
    """`block` with its first line (the reader's models) set to `models`."""
    first, rest = block.split("\n", 1)
    assert first.split("=")[0] + "=" == f"{next(iter(models))}=", first
    return " ".join(f"{name}={path}" for name, path in models.items()) + "\n" + rest


@contextmanager
def running_as_written(
    script: str,
    tmp_path: Path,
    commands: dict[str, Path],
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    output: Path | None = None,
) -> Iterator[subprocess.Popen]:
    """`script` run by bash in `cwd` (else `tmp_path`), `commands` (name: program) first
    on PATH, this checkout's `spillover` next, what it prints kept in `output`;
    everything it started is stopped at the end."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, program in commands.items():
        (bin_dir / name).symlink_to(program)
    path = f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    with open(output or os.devnull, "wb") as printed:
        run = subprocess.Popen(
            ["bash", "-c", script], cwd=cwd or tmp_path, start_new_session=True,
            env={**os.environ, **(env or {}), "PATH": path},
            stdout=printed, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        yield run
    finally:
        _stop_group(run)


def _stop_group(run: subprocess.Popen) -> None:
    """Stop bash and every process it started, and wait until they are gone (their
    ports free for the next block)."""
    os.killpg(run.pid, signal.SIGTERM)
    run.wait(timeout=60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline + 10:
        try:
            os.killpg(run.pid, signal.SIGKILL if time.monotonic() > deadline else 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)


def wait_until_ready(*urls: str, timeout: float = 120) -> dict:
    """Until the proxy has settled what each server in `urls` is, and none is down (one
    that was not up when the proxy started is until its /health answers): its status's
    servers (an AssertionError after `timeout`)."""
    deadline = time.monotonic() + timeout
    status: dict = {}
    while time.monotonic() < deadline:
        try:
            status = httpx.get(f"{PROXY}/spillover/status").json()
            servers, states = status["servers"], status["routing"]["states"]
            if all(
                servers.get(url, {}).get("settled") and states[url]["state"] in CALM for url in urls
            ):
                return servers
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"the proxy has not settled {urls} within {timeout:.0f}s: {status}")
