"""`scripts.services`: the files it writes run the proxy and the guard as a service
manager would start them (the commands are taken from the unit files themselves), and
`uninstall` takes them away again. The units are checked with `systemd-analyze verify`
where that is installed; tests/test_systemd_units.py runs the system units under a real
systemd."""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from scripts.guard import CANNOT_START
from scripts.parts.processes import free_port
from scripts.testbed.mitm import REPO
from scripts.testbed.workers import haproxy_missing
from tests.streams import chat_body


def services(config: Path, *args: str) -> str:
    env = {**os.environ, "XDG_CONFIG_HOME": str(config)}
    return subprocess.run(
        [sys.executable, "-m", "scripts.services", *args],
        cwd=REPO, env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip


def unit_command(unit: Path) -> tuple[list[str], Path]:
    lines = dict(line.split("=", 1) for line in unit.read_text().splitlines() if "=" in line)
    return shlex.split(lines["ExecStart"]), Path(lines.get("WorkingDirectory", REPO))


def wait_until(check, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError("never came up")


def test_install_runs_the_proxy_and_the_guard_and_uninstall_removes_them(
    primary, fallback, tmp_path: Path
) -> None:
    config = tmp_path / "config"
    listen, proxy_port = free_port(), free_port()
    said = services(
        config, "install", "--primary", primary.url, "--fallbacks", fallback.url,
        "--listen", f"127.0.0.1:{listen}", "--proxy-port", str(proxy_port), "--no-start",
    )  # fmt: skip
    options = config / "spillover" / "config.yaml"
    units = [
        config / "systemd" / "user" / name
        for name in ("spillover-proxy.service", "spillover-guard.service")
    ]
    assert f"wrote {options}" in said and all(unit.exists() for unit in units)
    if shutil.which("systemd-analyze"):
        verified = subprocess.run(
            ["systemd-analyze", "verify", *map(str, units)], capture_output=True, text=True
        )
        assert verified.returncode == 0, verified.stderr

    started = []
    try:
        for unit in units:
            argv, cwd = unit_command(unit)
            started.append(
                subprocess.Popen(
                    argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
        proxy = f"http://127.0.0.1:{proxy_port}"
        wait_until(lambda: httpx.get(f"{proxy}/spillover/status").status_code == 200)
        status = httpx.get(f"{proxy}/spillover/status").json()
        assert status["fallbacks"] == [fallback.url]  # the options file was read
        guard = f"http://127.0.0.1:{listen}"
        wait_until(lambda: httpx.get(f"{guard}/spillover/health").status_code == 200)
        reply = httpx.post(
            f"{guard}/v1/chat/completions", json={**chat_body(4), "stream": False}, timeout=30
        )
        assert reply.status_code == 200
    finally:
        for process in started:
            process.terminate()
            process.wait(timeout=10)

    # A person's edits are kept on a second install.
    options.write_text(options.read_text() + "spillover_health_s: 2\n")
    assert "keeping" in services(config, "install", "--primary", primary.url, "--no-start")
    assert "spillover_health_s: 2" in options.read_text()
    services(config, "uninstall", "--no-start", "--purge")
    assert not any(unit.exists() for unit in units) and not options.exists()


def test_a_public_guard_closes_the_control_routes_to_local_clients(tmp_path: Path) -> None:
    config = tmp_path / "config"
    listen = f"0.0.0.0:{free_port()}"
    said = services(
        config, "install", "--primary", "http://127.0.0.1:9", "--listen", listen, "--no-start"
    )
    assert "spillover_control_local: false" in (config / "spillover" / "config.yaml").read_text()
    guard = (config / "systemd" / "user" / "spillover-guard.service").read_text()
    assert f"--listen {listen}" in guard and "--public" in guard
    port = listen.rsplit(":", 1)[1]
    assert said.splitlines()[-1].startswith(
        f"services: clients use http://<this machine's address>:{port}/v1 (the guard"
    )


def test_the_public_configuration_keeps_its_guard_checking_the_proxy(
    primary, tmp_path: Path
) -> None:
    """What `install` writes for a public --listen, run: the guard's health check carries
    the control token, so it keeps passing clients through the proxy (without it the
    proxy's health route is closed to the guard, and the guard would go straight to the
    primary for good); the control routes are the token holder's only."""
    config = tmp_path / "config"
    listen, proxy_port = free_port(), free_port()
    services(
        config, "install", "--primary", primary.url, "--listen", f"0.0.0.0:{listen}",
        "--proxy-port", str(proxy_port), "--no-start",
    )  # fmt: skip
    token_path = config / "spillover" / "control-token"
    token = token_path.read_text().strip()
    assert len(token) >= 32 and token_path.stat().st_mode & 0o077 == 0
    options = (config / "spillover" / "config.yaml").read_text()
    assert token not in options  # named by its file, not copied
    units = [
        config / "systemd" / "user" / n
        for n in ("spillover-proxy.service", "spillover-guard.service")
    ]
    guard_log = tmp_path / "guard.log"
    started = []
    try:
        with guard_log.open("wb") as log:
            for unit in units:
                argv, cwd = unit_command(unit)
                started.append(subprocess.Popen(argv, cwd=cwd, stdout=log, stderr=log))
            guard = f"http://127.0.0.1:{listen}"
            bearer = {"authorization": f"Bearer {token}"}
            wait_until(
                lambda: httpx.get(f"{guard}/spillover/status", headers=bearer).status_code == 200
            )
            time.sleep(2.0)  # ten health checks
            said = guard_log.read_text()
            assert "not answering" not in said, said
            reply = httpx.post(
                f"{guard}/v1/chat/completions", json={**chat_body(4), "stream": False}, timeout=30
            )
            assert reply.status_code == 200
            assert httpx.get(f"{guard}/spillover/status").status_code == 404  # the primary's
            status = httpx.get(f"{guard}/spillover/status", headers=bearer)
            assert status.status_code == 200 and "routing" in status.json()
    finally:
        for process in started:
            process.terminate()
            process.wait(timeout=10)
    services(config, "uninstall", "--no-start", "--purge")
    assert not token_path.exists()


def without_systemd(tmp_path: Path) -> dict[str, str]:
    """An environment whose `systemctl` fails as it does on a machine with no user bus (the
    real one would start services on a machine that has one)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "systemctl"
    fake.write_text("#!/bin/sh\necho 'Failed to connect to bus: No medium found' >&2\nexit 1\n")
    fake.chmod(0o755)
    return {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config"),
            "PATH": f"{bin_dir}:{os.environ['PATH']}"}  # fmt: skip


def test_without_a_user_systemd_install_says_how_to_start_by_hand(tmp_path: Path) -> None:
    env = without_systemd(tmp_path)
    ports = ["--listen", f"127.0.0.1:{free_port()}", "--proxy-port", str(free_port())]
    run = subprocess.run(
        [sys.executable, "-m", "scripts.services", "install", "--primary", "http://127.0.0.1:9",
         *ports],
        cwd=REPO, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0 and "Traceback" not in run.stderr
    assert (
        "not started: systemctl --user daemon-reload failed (Failed to connect to bus" in run.stdout
    )
    assert "start them by hand:" in run.stdout and "spillover run --confdir " in run.stdout
    again = subprocess.run(
        [sys.executable, "-m", "scripts.services", "install", "--primary", "http://127.0.0.1:7",
         *ports, "--no-start"],
        cwd=REPO, env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "WARNING:" in again and "does not name http://127.0.0.1:7, given now" in again


def test_an_options_file_that_names_the_addon_file_is_mended(tmp_path: Path) -> None:
    """An earlier install named the addon's file in a checkout; the unit's `spillover run`
    loads the addon itself, and mitmproxy would load it twice. It also had the proxy on
    8090, where the guard listens now: the proxy's port is the one the guard is told."""
    config = tmp_path / "config"
    services(config, "install", "--primary", "http://127.0.0.1:9", "--no-start")
    options = config / "spillover" / "config.yaml"
    written = options.read_text()
    assert "scripts:" not in written
    mode = "mode:\n  - reverse:http://127.0.0.1:9@127.0.0.1:8091\n"
    old = "mode:\n  - reverse:http://127.0.0.1:9@127.0.0.1:8090\n"
    options.write_text(
        written.replace(mode, old + "scripts:\n  - /old/checkout/addon/spillover.py\n")
    )
    said = services(config, "install", "--primary", "http://127.0.0.1:9", "--no-start")
    assert "named the addon's file: removed" in said and options.read_text() == written
    assert "had the proxy on port 8090: now 8091" in said
    guard = (config / "systemd" / "user" / "spillover-guard.service").read_text()
    assert "--listen 127.0.0.1:8090 --proxy 127.0.0.1:8091 " in guard
    proxy = (config / "systemd" / "user" / "spillover-proxy.service").read_text()
    assert f"ExecStart={Path(sys.executable).parent / 'spillover'} run --confdir " in proxy


def test_with_workers_one_unit_runs_them_behind_haproxy(primary, fallback, tmp_path: Path) -> None:
    """`install --workers 2`: one unit, `spillover run --workers 2` on the clients'
    address (HAProxy does the guard's job, so no guard unit); the options file holds the
    rest and every worker reads it."""
    if (missing := haproxy_missing()) is not None:
        pytest.skip(missing)
    config = tmp_path / "config"
    listen = free_port()
    services(
        config, "install", "--primary", primary.url, "--fallbacks", fallback.url,
        "--listen", f"127.0.0.1:{listen}", "--workers", "2", "--no-start",
    )  # fmt: skip
    units = config / "systemd" / "user"
    assert not (units / "spillover-guard.service").exists()
    options = config / "spillover" / "config.yaml"
    assert "mode:" not in options.read_text()
    options.write_text(options.read_text() + "spillover_interval_ms: 35\n")
    argv, cwd = unit_command(units / "spillover-proxy.service")
    assert argv[1:3] == ["run", "--confdir"] and "--workers" in argv
    log = (tmp_path / "workers.log").open("wb")
    process = subprocess.Popen(argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    try:
        clients = f"http://127.0.0.1:{listen}"
        wait_until(lambda: "2 workers up behind HAProxy" in (tmp_path / "workers.log").read_text())
        status = httpx.get(f"{clients}/spillover/status").json()
        for worker in [status, *status["other_workers"]]:
            assert worker["fallbacks"] == [fallback.url]
            assert worker["memory"]["interval_ms"] == 35  # from the options file
        reply = httpx.post(
            f"{clients}/v1/chat/completions", json={**chat_body(4), "stream": False}, timeout=30
        )
        assert reply.status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
    services(config, "uninstall", "--no-start", "--purge")
    assert not (units / "spillover-proxy.service").exists()


def verify(*units: Path) -> None:
    if shutil.which("systemd-analyze"):
        verified = subprocess.run(
            ["systemd-analyze", "verify", *map(str, units)], capture_output=True, text=True
        )
        assert verified.returncode == 0, verified.stderr


def unit_lines(unit: Path) -> list[str]:
    return unit.read_text().splitlines()


def test_system_units_start_at_boot_as_their_own_user_after_the_engines(tmp_path: Path) -> None:
    """`install --system` (into temporary directories here, /etc by default): the units
    start at boot (multi-user.target) once the network is up and after the engines' own
    units, as a user of their own; user units order themselves after nothing they cannot
    know (network.target means nothing to a user's manager)."""
    etc, units = tmp_path / "etc", tmp_path / "units"
    said = services(
        tmp_path / "home", "install", "--system", "--config-dir", str(etc), "--unit-dir",
        str(units), "--primary", "http://127.0.0.1:8081", "--fallbacks", "http://127.0.0.1:8082",
        "--after", "llama-server.service,vllm.service", "--no-start",
    )  # fmt: skip
    if not [user for user in pwd.getpwall() if user.pw_name == "spillover"]:
        # Only writing: the user is not made, and the message says how.
        assert "no user spillover here: `useradd --system" in said, said
    proxy, guard = units / "spillover-proxy.service", units / "spillover-guard.service"
    verify(proxy, guard)
    for unit in (proxy, guard):
        lines = unit_lines(unit)
        assert "After=network-online.target llama-server.service vllm.service" in lines
        assert "Wants=network-online.target" in lines and "User=spillover" in lines
        assert "WantedBy=multi-user.target" in lines
    assert f"ExecStart={sys.executable.rsplit('/', 1)[0]}/spillover run --confdir {etc}" in (
        unit_lines(proxy)
    )
    # A guard that cannot start (its port taken) is not started again and again.
    assert f"RestartPreventExitStatus={CANNOT_START}" in unit_lines(guard)
    assert (etc / "config.yaml").exists()
    services(tmp_path / "home", "install", "--primary", "http://127.0.0.1:8081", "--no-start")
    user = tmp_path / "home" / "systemd" / "user" / "spillover-proxy.service"
    assert not [line for line in unit_lines(user) if line.startswith("After=")]
    assert "WantedBy=default.target" in unit_lines(user)
    verify(user)


def test_the_transparent_mode_runs_as_one_system_unit_with_the_capability_it_needs(
    tmp_path: Path,
) -> None:
    """Clients keep the primary's URL: the kernel's rules, gone with the proxy, do the
    guard's job, so there is no guard; the unit gets CAP_NET_ADMIN and nothing more. A
    user unit cannot have it: refused."""
    etc, units = tmp_path / "etc", tmp_path / "units"
    services(
        tmp_path / "home", "install", "--system", "--transparent", "--config-dir", str(etc),
        "--unit-dir", str(units), "--primary", "http://10.0.0.5:8081",
        "--fallbacks", "http://10.0.0.6:8082", "--listen", "127.0.0.1:8090", "--no-start",
    )  # fmt: skip
    (proxy,) = units.iterdir()
    verify(proxy)
    lines = unit_lines(proxy)
    assert "AmbientCapabilities=CAP_NET_ADMIN" in lines
    assert "CapabilityBoundingSet=CAP_NET_ADMIN" in lines
    start = next(line for line in lines if line.startswith("ExecStart="))
    assert "--primary http://10.0.0.5:8081" in start and "--transparent" in start
    assert "mode:" not in (etc / "config.yaml").read_text()  # the command names the route
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "home")}
    refused = subprocess.run(
        [sys.executable, "-m", "scripts.services", "install", "--transparent", "--primary",
         "http://10.0.0.5:8081", "--no-start"],
        cwd=REPO, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert refused.returncode != 0 and "a system service only (--system)" in refused.stderr
