"""The system units under a real systemd: PID 1 of a container made of this machine's
own /usr and /etc, where docker runs (skipped, saying why, where it does not)."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from scripts.guard import CANNOT_START
from scripts.parts.processes import free_port
from scripts.testbed.containers import DockerUnavailable, docker, ensure_daemon, systemd_image
from scripts.testbed.mitm import REPO
from tests.streams import chat_body
from tests.test_services import wait_until


def test_system_units_run_under_systemd_restart_and_start_again_at_boot(
    primary, tmp_path: Path
) -> None:
    """Under a real systemd: PID 1 of a container made of this machine's own /usr and
    /etc (read-only; the units' folder and the options' are the container's own, so none
    of this machine's services starts there), on its network. `install --system --run-as
    nobody` (a user that exists) makes the options' folder that user's (mitmproxy writes
    its certificate authority there) and starts both units: a client's request through
    the guard is answered by the primary. The proxy SIGKILLed is started again
    (Restart=on-failure), and after the container reboots both units start at boot. An
    install again while they run restarts them (their own ports are not "taken"); the
    guard with its port taken by another program fails once and stays down."""
    try:
        ensure_daemon()
        image = systemd_image()
    except DockerUnavailable as why:
        pytest.skip(f"no systemd container here: {why}")
    units, options = tmp_path / "units", tmp_path / "options"
    units.mkdir()
    options.mkdir()
    mounts = {"/usr": "ro", "/etc": "ro", str(units): "/etc/systemd/system",
              str(options): "/srv/spillover", "/sys/fs/cgroup": "rw", str(REPO): "ro"}  # fmt: skip
    if not sys.base_prefix.startswith("/usr/"):
        mounts[sys.base_prefix] = "ro"  # the venv's own Python
    volumes = [
        f"{here}:{how}" if how.startswith("/") else f"{here}:{here}:{how}"
        for here, how in mounts.items()
    ]
    name = f"spillover-systemd-{os.getpid()}"
    # SYS_PTRACE: root on a host may read other users' /proc/<pid>/fd (which process
    # holds a port), and so may `install` here.
    started = docker(
        "run", "-d", "--name", name, "--cap-add", "SYS_ADMIN", "--cap-add", "SYS_PTRACE",
        "--network", "host", "--cgroupns", "host", "--stop-signal", "SIGRTMIN+3", "--tmpfs", "/run",
        "--tmpfs", "/run/lock", "--tmpfs", "/tmp", *[a for v in volumes for a in ("-v", v)],
        image, "/lib/systemd/systemd",
    )  # fmt: skip
    assert started.returncode == 0, started.stderr

    def inside(*argv: str) -> str:
        return docker("exec", name, *argv).stdout.strip()

    def proxy_answers() -> bool:
        return httpx.get(f"{proxy}/spillover/health").status_code == 200

    def proxy_pid() -> str:
        return inside("systemctl", "show", "-p", "MainPID", "--value", "spillover-proxy")

    listen, proxy_port = free_port(), free_port()
    proxy = f"http://127.0.0.1:{proxy_port}"
    try:
        wait_until(lambda: inside("systemctl", "is-system-running") in ("running", "degraded"))
        install = [
            "exec", name, str(Path(sys.executable).parent / "spillover"), "services", "install",
            "--system", "--run-as", "nobody", "--config-dir", "/srv/spillover",
            "--primary", primary.url, "--listen", f"127.0.0.1:{listen}",
            "--proxy-port", str(proxy_port),
        ]  # fmt: skip
        said = docker(*install)
        assert said.returncode == 0 and "clients use" in said.stdout, said.stdout + said.stderr
        wait_until(proxy_answers)
        body = {**chat_body(8), "stream": False}
        via = httpx.post(f"http://127.0.0.1:{listen}/v1/chat/completions", json=body, timeout=60)
        direct = httpx.post(f"{primary.url}/v1/chat/completions", json=body, timeout=60)
        assert via.json()["choices"] == direct.json()["choices"]
        pid = proxy_pid()
        assert inside("stat", "-c", "%U", f"/proc/{pid}") == "nobody"
        assert inside("stat", "-c", "%U", "/srv/spillover/mitmproxy-ca.pem") == "nobody"
        inside("kill", "-9", pid)
        wait_until(lambda: proxy_pid() not in ("0", pid))
        wait_until(proxy_answers)
        restarted = docker("restart", "-t", "20", name, timeout=60)
        assert restarted.returncode == 0, restarted.stderr
        wait_until(proxy_answers)
        booted = inside("systemctl", "is-active", "spillover-proxy", "spillover-guard")
        assert booted.split() == ["active", "active"]
        # Installed again while running: the ports its own units hold are not "taken",
        # and the units are restarted with what was written.
        pid = proxy_pid()
        again = docker(*install)
        assert again.returncode == 0 and "taken" not in again.stdout, again.stdout + again.stderr
        wait_until(lambda: proxy_pid() not in ("0", pid))
        wait_until(proxy_answers)
        # Its port taken by another program, the guard fails once and stays down (its
        # exit code is in RestartPreventExitStatus=) instead of restarting every second.
        inside("systemctl", "stop", "spillover-guard")
        with socket.create_server(("127.0.0.1", listen)):
            inside("systemctl", "start", "spillover-guard")
            # Until it has ended (a loaded machine starts its Python late), 3 s at least:
            # a guard restarting every second would show it by then.
            deadline, ended = time.monotonic() + 30, time.monotonic() + 3
            while True:
                shown = inside(
                    "systemctl", "show", "-p", "ActiveState,ExecMainStatus,NRestarts",
                    "spillover-guard",
                )  # fmt: skip
                now = time.monotonic()
                if now > deadline or (now > ended and "ActiveState=failed" in shown.split()):
                    break
                time.sleep(0.2)
        assert sorted(shown.split()) == [
            "ActiveState=failed",
            f"ExecMainStatus={CANNOT_START}",
            "NRestarts=0",
        ], shown
    finally:
        docker("rm", "-f", name)
