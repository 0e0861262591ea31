"""What `services install` checks before it writes anything, with real sockets, real
folders and the kernel's own answer: ports that are a server's or taken here, a command
the system service's user may not run (`scripts.parts.access`, compared with what the
kernel lets `nobody` do), and the servers' cards written for a user that cannot see the
servers' processes."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import site
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.parts.access import READ, RUN, User, cannot_use
from scripts.parts.processes import free_port
from scripts.testbed.mitm import REPO
from tests.test_services import without_systemd
from watchers.sources import ALL, card_map, open_sources

AS_ROOT = pytest.mark.skipif(
    os.geteuid() != 0, reason="the kernel's answer for another user (runuser) needs root"
)


def test_install_refuses_a_servers_address_and_a_taken_port(tmp_path: Path) -> None:
    """One line each, an exit code that is not 0, and nothing written; a port taken here
    is named with the process that holds it. With --no-start what this machine says now
    is only said: the files may be meant for later."""
    env = without_systemd(tmp_path)

    def install(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "scripts.services", "install", "--primary", primary,
             "--fallbacks", fallback, *args],
            cwd=REPO, env=env, capture_output=True, text=True,
        )  # fmt: skip

    primary_port, fallback_port, spare = free_port(), free_port(), free_port()
    primary = f"http://127.0.0.1:{primary_port}"
    fallback = f"http://localhost:{fallback_port}"
    refused = {
        ("--listen", f"127.0.0.1:{primary_port}", "--proxy-port", str(spare)):
            f"--listen 127.0.0.1:{primary_port} is the server {primary}'s own address",
        ("--listen", f"0.0.0.0:{primary_port}", "--proxy-port", str(spare)):
            f"--listen 0.0.0.0:{primary_port} is the server {primary}'s own address",
        ("--listen", f"127.0.0.1:{spare}", "--proxy-port", str(fallback_port)):
            f"--proxy-port 127.0.0.1:{fallback_port} is the server {fallback}'s own address",
        ("--listen", f"127.0.0.1:{spare}", "--proxy-port", str(spare)):
            "--listen and --proxy-port name one port",
    }  # fmt: skip
    for args, why in refused.items():
        run = install(*args)
        assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr
        assert [line for line in run.stderr.splitlines() if why in line], (args, run.stderr)
    assert not (tmp_path / "config").exists()

    me = Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        ports = ("--listen", f"127.0.0.1:{port}", "--proxy-port", str(spare))
        run = install(*ports)
        taken = f"--listen: 127.0.0.1:{port} is taken by pid {os.getpid()} ({me})"
        assert run.returncode != 0 and run.stderr.splitlines() == [f"services: {taken}"]
        assert not (tmp_path / "config").exists()
        written = install(*ports, "--no-start")
    assert written.returncode == 0 and f"services: WARNING: {taken}" in written.stdout
    assert (tmp_path / "config" / "spillover" / "spillover.yaml").exists()
    assert written.stdout.splitlines()[-1] == (
        f"services: clients use http://127.0.0.1:{port}/v1 (the guard; the proxy behind it "
        f"listens on 127.0.0.1:{spare})"
    )


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A folder every user may enter (pytest's own is its owner's only)."""
    folder = Path(tempfile.mkdtemp())
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def kernel_lets_nobody(path: Path, bits: int) -> bool:
    tests = {READ | RUN: ["-r", str(path), "-a", "-x", str(path)], RUN: ["-x", str(path)],
             READ: ["-r", str(path)]}[bits]  # fmt: skip
    return subprocess.run(["runuser", "-u", "nobody", "--", "test", *tests]).returncode == 0


@AS_ROOT
def test_what_the_service_user_may_run_is_what_the_kernel_lets_it(open_tmp: Path) -> None:
    """Owner's, group's and others' bits, the class the kernel takes (a user in the
    folder's group gets the group's bits, not the others'), folders it may enter but not
    read, files it may run but not read (a script needs both)."""
    nogroup = pwd.getpwnam("nobody").pw_gid
    cases = {  # folder mode, its group is nobody's, file mode, what is needed
        "open": (0o755, False, 0o755, READ | RUN),
        "closed folder": (0o700, False, 0o755, RUN),
        "group folder": (0o750, True, 0o750, READ | RUN),
        "group shut out": (0o705, True, 0o755, RUN),
        "enter only": (0o711, False, 0o711, RUN),
        "script run only": (0o711, False, 0o711, READ | RUN),
        "not runnable": (0o755, False, 0o644, RUN),
    }
    nobody = User.named("nobody")
    for name, (folder_mode, grouped, file_mode, bits) in cases.items():
        folder = open_tmp / name.replace(" ", "-")
        folder.mkdir()
        made = folder / "spillover"
        made.write_text("#!/bin/sh\n")
        for path, mode in ((folder, folder_mode), (made, file_mode)):
            path.chmod(mode)
            if grouped:
                os.chown(path, -1, nogroup)
        for path in (made, folder):
            verdict = cannot_use(nobody, {path: bits})
            assert (verdict is None) == kernel_lets_nobody(path, bits), (name, path, verdict)


@AS_ROOT
def test_a_system_install_refuses_a_command_its_user_cannot_run(open_tmp: Path) -> None:
    """A venv in a home the service user may not enter (0700, as many are): the unit
    would fail with 203/EXEC. Refused in one line naming the folder, nothing written;
    with --no-start only said."""
    home = open_tmp / "home"
    home.mkdir(mode=0o700)
    venv = home / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    packages = next((venv / "lib").glob("python*/site-packages"))
    (packages / "project.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    shutil.copy(Path(sys.executable).parent / "spillover", venv / "bin" / "spillover")
    etc, units = open_tmp / "etc", open_tmp / "units"
    argv = [
        str(venv / "bin" / "python"), "-m", "scripts.services", "install", "--system",
        "--run-as", "nobody", "--config-dir", str(etc), "--unit-dir", str(units),
        "--primary", "http://127.0.0.1:9", "--listen", f"127.0.0.1:{free_port()}",
        "--proxy-port", str(free_port()),
    ]  # fmt: skip
    env = without_systemd(open_tmp)
    refused = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    assert refused.returncode != 0 and len(refused.stderr.splitlines()) == 1, refused.stderr
    named = re.search(r"nobody cannot enter (\S+) \(drwx------ ", refused.stderr)
    assert named is not None and Path(named[1]) == home, refused.stderr
    assert not kernel_lets_nobody(home, RUN) and kernel_lets_nobody(home.parent, RUN)
    assert "/opt/spillover" in refused.stderr and not etc.exists() and not units.exists()
    written = subprocess.run(
        [*argv, "--no-start"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert written.returncode == 0 and "WARNING: nobody cannot enter" in written.stdout
    assert (units / "spillover-proxy.service").exists()


@AS_ROOT
def test_a_system_install_names_a_settings_file_its_user_cannot_read(open_tmp: Path) -> None:
    """`install --system --config FILE`: the proxy's unit runs as --run-as with that very
    file, so a file in a home it may not enter, or one it may not read, would stop the
    proxy at start; said in one line naming the folder or the file, as the kernel answers
    (with --no-start as a warning, the units written all the same)."""
    home = open_tmp / "home"
    home.mkdir(mode=0o700)
    shut = open_tmp / "shut.yaml"
    for path in (home / "spillover.yaml", shut):
        path.write_text("primary: http://127.0.0.1:9\n")
    shut.chmod(0o600)
    etc, units = open_tmp / "etc", open_tmp / "units"
    for settings, why in (
        (home / "spillover.yaml", f"nobody cannot enter {home} (drwx------ root:root), on the "
                                  f"way to {home / 'spillover.yaml'}"),
        (shut, f"nobody cannot read {shut} (-rw------- root:root)"),
    ):  # fmt: skip
        assert not kernel_lets_nobody(settings, READ)
        said = subprocess.run(
            [sys.executable, "-m", "scripts.services", "install", "--system", "--run-as",
             "nobody", "--config", str(settings), "--config-dir", str(etc), "--unit-dir",
             str(units), "--listen", f"127.0.0.1:{free_port()}", "--proxy-port",
             str(free_port()), "--no-start"],
            cwd=REPO, capture_output=True, text=True,
        )  # fmt: skip
        assert said.returncode == 0, said.stderr
        assert (
            f"services: WARNING: {why}, so the proxy could not read its settings: put the file "
            "where nobody may read it (such as the services' folder, --config-dir)\n"
        ) in said.stdout, said.stdout
        assert f"run --config {settings} " in (units / "spillover-proxy.service").read_text()
    shut.chmod(0o644)
    assert kernel_lets_nobody(shut, READ) and cannot_use(User.named("nobody"), {shut: READ}) is None


def test_a_system_install_names_the_cards_of_servers_its_user_cannot_see(
    primary, fallback, tmp_path: Path
) -> None:
    """The servers are this test's processes, not nobody's: a proxy run as nobody may not
    read their /proc/<pid>/fd and would map no card. `install --system --run-as nobody`
    writes the cards the proxy's own mapping finds (with this user's rights) into the
    options; with a server not running it writes none and says the whole line to add;
    for a service user whose processes the servers are, it writes none."""
    sources, _ = open_sources(ALL)
    for source in sources:
        source.read()
    mapping = card_map({}, sources, Path("/proc"), Path("/sys"))
    cards = {url: "+".join(sorted(mapping.cards_of(url))) for url in (primary.url, fallback.url)}
    assert all(cards.values()), cards

    def install(run_as: str, *servers: str) -> tuple[str, str]:
        etc = tmp_path / f"etc-{run_as}-{len(servers)}"
        said = subprocess.run(
            [sys.executable, "-m", "scripts.services", "install", "--system", "--run-as", run_as,
             "--config-dir", str(etc), "--unit-dir", str(tmp_path / "units"), "--primary",
             servers[0], "--fallbacks", ",".join(servers[1:]), "--listen",
             f"127.0.0.1:{free_port()}", "--proxy-port", str(free_port()), "--no-start"],
            cwd=REPO, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        return said, (etc / "spillover.yaml").read_text()

    said, options = install("nobody", primary.url, fallback.url)
    entries = ",".join(f"{url}={on}" for url, on in cards.items())
    line = f'spillover_cards: "{entries}"'
    assert f"{line}\n" in options and "are not nobody's" in said, said
    said, kept = install("nobody", primary.url, fallback.url)  # a second install keeps them
    assert f"{line}\n" in kept and "names its own spillover_cards: kept" in said, said

    stopped = f"http://127.0.0.1:{free_port()}"
    said, options = install("nobody", primary.url, fallback.url, stopped)
    assert "spillover_cards" not in options
    added = re.search(r"add this line to (\S+): (spillover_cards: .*) \(CARD: one of (.*)\)", said)
    assert added is not None, said
    assert added[2] == f'spillover_cards: "{entries},{stopped}=CARD"'
    assert set(cards[primary.url].split("+")) <= set(added[3].split(", "))

    owner = pwd.getpwuid(os.getuid()).pw_name
    said, options = install(owner, primary.url, fallback.url)
    assert "spillover_cards" not in options and "spillover_cards" not in said
