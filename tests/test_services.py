"""`scripts.services`: the files it writes run the proxy and the guard as a service
manager would start them (the commands are taken from the unit files themselves), and
`uninstall` takes them away again. The units are checked with `systemd-analyze verify`
where that is installed; tests/test_systemd_units.py runs the system units under a real
systemd."""

from __future__ import annotations

import json
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
from mitmproxy.optmanager import parse

from scripts.guard import CANNOT_START
from scripts.parts.processes import free_port
from scripts.services import UNITS
from scripts.testbed.memfiles import FakeCard
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
    options = config / "spillover" / "spillover.yaml"
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


def test_the_units_run_with_a_settings_file_that_status_and_doctor_read_too(
    primary, fallback, tmp_path: Path
) -> None:
    """`install --config FILE`: the units point at the person's own file (nothing is
    written beside it): its port is the clients' (the guard's), its options and
    mitmdump's own flow_detail reach the proxy. `status --config FILE` asks the proxy
    there through the guard, and `doctor --config FILE` checks the file's servers with
    the file's cards, no flag repeated."""
    sysfs = tmp_path / "sys"
    FakeCard(sysfs, "card0", total_mib=16384, used_mib=10000)
    listen, proxy_port = free_port(), free_port()
    settings = tmp_path / "mine" / "spillover.yaml"
    settings.parent.mkdir()
    settings.write_text(
        f"primary: {primary.url}\nfallbacks: [{fallback.url}]\nport: {listen}\n"
        f"interval_ms: 35\nflow_detail: 1\ncards: {primary.url}=drm:card0\n"
        f"sysfs_root: {sysfs}\n"  # (the proxy's and the doctor's: card0 is a stand-in's)
    )
    config = tmp_path / "config"
    said = services(config, "install", "--config", str(settings), "--proxy-port",
                    str(proxy_port), "--no-start")  # fmt: skip
    assert f"status, watch, doctor and stress read it too: --config {settings}" in said
    assert sorted(path.name for path in settings.parent.iterdir()) == ["spillover.yaml"]
    assert not (config / "spillover" / "spillover.yaml").exists()
    units = config / "systemd" / "user"
    guard = (units / "spillover-guard.service").read_text()
    assert f"--listen 127.0.0.1:{listen} --proxy 127.0.0.1:{proxy_port} " in guard
    started = []
    try:
        for unit in ("spillover-proxy.service", "spillover-guard.service"):
            argv, cwd = unit_command(units / unit)
            assert argv[1:4] == ["run", "--config", str(settings)] or unit != UNITS[0]
            started.append(subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL))  # fmt: skip
        guarded = f"http://127.0.0.1:{listen}"
        wait_until(lambda: httpx.get(f"{guarded}/spillover/status").status_code == 200)
        spillover = [sys.executable, "-m", "scripts.cli"]
        status = subprocess.run([*spillover, "status", "--config", str(settings), "--json"],
                                cwd=REPO, capture_output=True, text=True)  # fmt: skip
        assert status.returncode == 0, status.stderr
        shown = json.loads(status.stdout)
        assert shown["fallbacks"] == [fallback.url] and shown["memory"]["interval_ms"] == 35
        assert shown["pid"] == started[0].pid  # the proxy's, behind the guard
    finally:
        for process in started:
            process.terminate()
            process.wait(timeout=10)
    doctor = subprocess.run(
        [*spillover, "doctor", "--config", str(settings)],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert (
        f"ok  {primary.url}: llama-server, primary.gguf, 1024 ctx/slot; cards: drm:card0 "
        "(by explicit: spillover_cards)"
    ) in doctor.stdout, doctor.stdout + doctor.stderr
    assert f"ok  {fallback.url}: llama-server, fallback.gguf" in doctor.stdout


def test_a_public_guard_closes_the_control_routes_to_local_clients(tmp_path: Path) -> None:
    config = tmp_path / "config"
    listen = f"0.0.0.0:{free_port()}"
    said = services(
        config, "install", "--primary", "http://127.0.0.1:9", "--listen", listen, "--no-start"
    )
    assert "control_local: false" in (config / "spillover" / "spillover.yaml").read_text()
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
    options = (config / "spillover" / "spillover.yaml").read_text()
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
            # The settings file names the address (0.0.0.0: asked on loopback) and the token.
            settings = config / "spillover" / "spillover.yaml"
            status = subprocess.run(
                [sys.executable, "-m", "scripts.cli", "status", "--config", str(settings),
                 "--json"], cwd=REPO, capture_output=True, text=True,
            )  # fmt: skip
            assert status.returncode == 0 and "routing" in json.loads(status.stdout), status
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
    assert "start them by hand:" in run.stdout and "spillover run --config " in run.stdout
    again = subprocess.run(
        [sys.executable, "-m", "scripts.services", "install", "--primary", "http://127.0.0.1:7",
         *ports, "--no-start"],
        cwd=REPO, env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "WARNING:" in again and "does not name http://127.0.0.1:7 as its primary" in again
    proxy = (tmp_path / "config/systemd/user/spillover-proxy.service").read_text()
    assert " --primary http://127.0.0.1:7 " in proxy  # the flag given wins over the file


EARLIER_OPTIONS = """\
# The spillover proxy's options, in mitmproxy's own format
mode:
  - reverse:http://127.0.0.1:9@127.0.0.1:8090
scripts:
  - /old/checkout/addon/spillover.py
spillover_fallbacks: "http://127.0.0.1:7"
flow_detail: 0
spillover_health_s: 2
"""


def test_an_earlier_installs_options_become_the_settings_file(tmp_path: Path) -> None:
    """An earlier version wrote mitmproxy's own options file into the services' folder
    (the reverse mode, the addon's file in a checkout), which mitmdump reads besides
    whatever it is given. Installed again, its options become the settings file (the
    addon and the ports are the units' business now) and it is moved aside; a key in it
    that mitmdump ignored is refused, naming the file, before anything is written."""
    config = tmp_path / "config"
    folder = config / "spillover"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(EARLIER_OPTIONS + "web_port: 8070\n")
    env = {**os.environ, "XDG_CONFIG_HOME": str(config)}
    refused = subprocess.run(
        [sys.executable, "-m", "scripts.services", "install", "--no-start"],
        cwd=REPO, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr == (
        f"services: {folder / 'config.yaml'}: {folder / 'spillover.yaml'}: unknown key "
        "web_port: mitmweb's option (or the console's), and spillover run starts mitmdump\n"
    )
    assert sorted(path.name for path in folder.iterdir()) == ["config.yaml"]
    (folder / "config.yaml").write_text(EARLIER_OPTIONS)
    said = services(config, "install", "--no-start")
    assert f"{folder / 'config.yaml'} is not read now: moved to config.yaml.old" in said
    settings = parse((folder / "spillover.yaml").read_text())
    assert settings == {
        "primary": "http://127.0.0.1:9", "fallbacks": ["http://127.0.0.1:7"], "flow_detail": 0,
        "spillover_health_s": 2, "listen_host": "127.0.0.1", "port": 8090,
    }  # fmt: skip
    assert (folder / "config.yaml.old").read_text() == EARLIER_OPTIONS
    guard = (config / "systemd" / "user" / "spillover-guard.service").read_text()
    assert "--listen 127.0.0.1:8090 --proxy 127.0.0.1:8091 --primary 127.0.0.1:9\n" in guard
    proxy = (config / "systemd" / "user" / "spillover-proxy.service").read_text()
    assert f"run --config {folder / 'spillover.yaml'} --confdir {folder} " in proxy


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
    options = config / "spillover" / "spillover.yaml"
    options.write_text(options.read_text() + "spillover_interval_ms: 35\n")
    argv, cwd = unit_command(units / "spillover-proxy.service")
    assert argv[1:3] == ["run", "--config"] and "--workers" in argv
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
    assert any(
        line.startswith(f"ExecStart={Path(sys.executable).parent}/spillover run --config "
                        f"{etc / 'spillover.yaml'} --confdir {etc} ")
        for line in unit_lines(proxy)
    ), unit_lines(proxy)  # fmt: skip
    # A guard that cannot start (its port taken) is not started again and again.
    assert f"RestartPreventExitStatus={CANNOT_START}" in unit_lines(guard)
    assert (etc / "spillover.yaml").exists()
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
    assert f"--config {etc / 'spillover.yaml'} " in start and "--transparent" in start
    assert 'primary: "http://10.0.0.5:8081"' in (etc / "spillover.yaml").read_text()
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "home")}
    refused = subprocess.run(
        [sys.executable, "-m", "scripts.services", "install", "--transparent", "--primary",
         "http://10.0.0.5:8081", "--no-start"],
        cwd=REPO, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert refused.returncode != 0 and "a system service only (--system)" in refused.stderr
