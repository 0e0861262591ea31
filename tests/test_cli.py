"""The `spillover` command: `run` starts a working proxy without the addon's path, and
each tool answers under it (a real mitmdump, real llama-servers)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import shutil
import struct
import subprocess
import sys
import tarfile
import termios
import time
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from scripts.parts.processes import free_port
from scripts.testbed.mitm import Mitmdump, SpilloverRun
from scripts.testbed.workers import haproxy_missing
from tests.streams import assert_one_clean_stream, chat_body, read_stream
from tests.test_raw_output import read_cut
from tests.throttle import Throttled

REPO = Path(__file__).resolve().parent.parent


def spillover(*args: str) -> subprocess.CompletedProcess[str]:
    run = [sys.executable, "-m", "scripts.cli", *args]
    return subprocess.run(run, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_run_starts_the_proxy_in_front_of_the_primary(
    start_server, fallback, server_logs: Path
) -> None:
    primary = start_server("primary")
    proxy = SpilloverRun(primary.url, [fallback.url], [], log_dir=server_logs).start(timeout=60)
    try:
        # The fallback proven first: a cut in the proxy's first moments ends the answer
        # with an in-band error ("not checked yet"), as a loaded run found.
        proxy.servers_known()
        with Throttled(primary.pid):  # (run free, it may write the whole answer before chunk 30)
            stream = read_stream(
                proxy.url, chat_body(200), on_chunk=lambda n: n == 30 and primary.kill()
            )
        assert_one_clean_stream(stream)
        assert f"{primary.url} -> {fallback.url}" in stream.notes[0]
        said = spillover("status", "--proxy", proxy.url, "--json")
        assert said.returncode == 0 and json.loads(said.stdout)["fallbacks"] == [fallback.url]
    finally:
        proxy.stop()
    assert f"listening at 127.0.0.1:{proxy.port}" in proxy.log_path.read_text()


class PlainRun(SpilloverRun):
    """`spillover run` with nothing after `--`: the log it writes by default."""

    def argv(self) -> list[str]:
        return [
            sys.executable, "-m", "scripts.cli", "run", "--primary", self.primary, "--fallbacks",
            ",".join(self.fallbacks), "--port", str(self.port), *self.flags,
        ]  # fmt: skip


@pytest.mark.parametrize("verbose", [False, True])
def test_runs_log_holds_the_handoffs_not_every_connection(
    verbose: bool, start_server, fallback, server_logs: Path
) -> None:
    """A real request through `spillover run`, handed off on request: the log says the
    handoff, and by default nothing of the connections (mitmproxy's client and server
    connects, the addon's own splice endpoint among them as a server on a random port)
    nor a line per flow; `-v` brings both back."""
    primary = start_server("primary")
    flags = ["-v"] if verbose else []
    proxy = PlainRun(primary.url, [fallback.url], flags, log_dir=server_logs).start(timeout=60)
    try:
        proxy.servers_known()
        stream = read_cut(proxy, chat_body(200), [primary], at=(30,))
        assert_one_clean_stream(stream)
        assert f"{primary.url} -> {fallback.url}" in stream.notes[0]
    finally:
        proxy.stop()
    log = proxy.log_path.read_text()
    assert f"{primary.url} -> {fallback.url}" in log, log
    connections = re.findall(r"(?:client|server) (?:dis)?connect|Streaming response", log)
    flows = re.findall(r"POST http://\S+/v1/chat/completions", log)
    if verbose:
        assert {"client connect", "server connect", "Streaming response"} <= set(connections)
        assert flows, log
    else:
        assert connections == [] and flows == [], log


def test_every_command_has_help_and_a_mistake_is_named() -> None:
    for command in ("run", "status", "doctor", "watch", "stress", "services", "guard"):
        said = spillover(command, "--help")
        assert said.returncode == 0 and "usage: spillover" in said.stdout, (command, said.stderr)
    wrong = spillover("run", "--primary", "http://127.0.0.1:9", "--fallback", "x")
    assert wrong.returncode == 2 and "unknown arguments --fallback x" in wrong.stderr
    for both, said in (
        (["--capture", "x", "--workers", "2"], "--capture runs one proxy (not --workers)"),
        (["--transparent", "--capture", "x"], "not allowed with argument"),
    ):
        wrong = spillover("run", "--primary", "http://127.0.0.1:9", *both)
        assert wrong.returncode == 2 and said in wrong.stderr, wrong.stderr
    nobody = spillover("status", "--proxy", "http://127.0.0.1:9")
    assert nobody.returncode == 1 and "no proxy at http://127.0.0.1:9" in nobody.stderr


def test_run_help_shows_its_defaults_and_where_the_rest_is_told() -> None:
    said = spillover("run", "--help").stdout
    assert "(default: 8090)" in said and "(default: 127.0.0.1)" in said
    assert "What follows `--` goes to mitmdump" in said and "`spillover options` lists" in said
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert spillover("--version").stdout == f"spillover {version}\n"


def test_options_lists_every_option_the_addon_declares() -> None:
    """Each `spillover_*` option in the addon's source, with its type, default and help."""
    declared = set(re.findall(r'"(spillover_[a-z0-9_]+)", (?:bool|int|str)\b', addon_source()))
    said = spillover("options")
    assert said.returncode == 0, said.stderr
    listed = dict(re.findall(r"^(spillover_\w+)  \((\w+), default ", said.stdout, re.MULTILINE))
    assert len(declared) > 30 and declared <= set(listed), declared - set(listed)
    assert listed["spillover_free_floor_mib"] == "int" and listed["spillover_hand_back"] == "bool"
    assert "spillover_fallbacks  (str, default '')\n    Comma-separated fallback servers" in (
        said.stdout
    )


def addon_source() -> str:
    return "\n".join(path.read_text() for path in (REPO / "addon").rglob("*.py"))


def clone_files() -> list[str]:
    """The files a clone of this repository has (from git where this is a checkout; an
    unpacked sdist has no .git, and its files are the clone's)."""
    if (REPO / ".git").exists():
        return subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
            text=True, check=True,
        ).stdout.split()  # fmt: skip
    skipped = (".venv", ".pytest_cache", ".ruff_cache", "__pycache__", "PKG-INFO", "setup.cfg")
    return [
        str(path.relative_to(REPO)) for path in REPO.rglob("*")
        if path.is_file() and not any(p in skipped or p.endswith(".egg-info") for p in path.parts)
    ]  # fmt: skip


@dataclass(frozen=True)
class Built:
    sdist: Path
    wheel: Path


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The sdist and the wheel `python -m build` makes from a copy of the clone's files
    (a checkout's egg-info would add what the package list lacks); the wheel is built
    from the sdist, as a package index's builders do."""
    tmp_path = tmp_path_factory.mktemp("built")
    dist, source = tmp_path / "dist", tmp_path / "source"
    for name in clone_files():
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "build", "-q", "--outdir", dist, source],
        check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    (sdist,) = dist.glob("spillover-*.tar.gz")
    (wheel,) = dist.glob("spillover-*.whl")
    return Built(sdist, wheel)


def test_the_sdist_holds_the_clone_and_its_tests_run_from_it(built: Built, tmp_path: Path) -> None:
    """Every file a clone has is in the sdist (the tests, the test bed, the tiny models'
    sources, the recordings, the manual, CI's script), and the tests are collected from
    the unpacked sdist as they are from the clone: nothing they import is missing."""
    with tarfile.open(built.sdist) as opened:
        opened.extractall(tmp_path, filter="data")
        names = {name.split("/", 1)[1] for name in opened.getnames() if "/" in name}
    missing = set(clone_files()) - names - {".gitignore"}
    assert not missing, sorted(missing)
    (unpacked,) = tmp_path.glob("spillover-*")

    def collected(where: Path) -> list[str]:
        listed = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
            cwd=where, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert listed.returncode == 0, listed.stdout[-3000:]
        return [line for line in listed.stdout.splitlines() if "::" in line]

    from_sdist = collected(unpacked)
    assert from_sdist and from_sdist == collected(REPO)


def on_a_terminal(argv: list[str], seconds: float = 3) -> str:
    """What `argv` draws in its first seconds on a terminal of 40 x 160 (a pty)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    drawing = subprocess.Popen(argv, stdin=follower, stdout=follower, stderr=follower,
                               env={**os.environ, "TERM": "xterm"})  # fmt: skip
    os.close(follower)
    shown, deadline = b"", time.monotonic() + seconds
    try:
        while (left := deadline - time.monotonic()) > 0:
            if select.select([leader], [], [], left)[0]:
                try:
                    shown += os.read(leader, 65536)
                except OSError:
                    break
    finally:
        drawing.terminate()
        drawing.wait(timeout=10)
        os.close(leader)
    return shown.decode(errors="replace")


PIP = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
TEST_BED = re.compile(r"^\s*(from|import) scripts\.(testbed|bench|gpu)\b", re.MULTILINE)


def test_the_wheel_installs_one_package_and_its_commands_run(built: Built, tmp_path: Path) -> None:
    """The wheel, installed (without its dependencies, which this venv has) into a folder
    of its own: one top-level package, `spillover`, with its license and without the test
    bed, the benchmarks or the GPU proof (nothing in it imports them); `addon`, `scripts`
    and `watchers` are not importable beside it, yet its command answers for every tool."""
    wheel = built.wheel
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    info = wheel.name.removesuffix("-py3-none-any.whl") + ".dist-info"
    assert tops == {"spillover", info}
    assert f"{info}/licenses/LICENSE" in names
    assert not [
        n
        for n in names
        if n.startswith(
            ("spillover/scripts/testbed", "spillover/scripts/bench", "spillover/scripts/gpu")
        )
    ]
    with zipfile.ZipFile(wheel) as opened:
        importing = [
            n for n in names if n.endswith(".py") and TEST_BED.search(opened.read(n).decode())
        ]
    assert not importing, importing
    target = tmp_path / "site"
    subprocess.run([*PIP, "install", "--no-deps", "--target", target, wheel], check=True)
    env = {**os.environ, "PYTHONPATH": str(target)}

    def installed(*args: str) -> subprocess.CompletedProcess[str]:
        probe = f"import sys, spillover; sys.argv = {['spillover', *args]!r}; spillover.main()"
        return subprocess.run([sys.executable, "-P", "-c", probe], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    alone = (
        "import importlib.util as u\n"
        "assert not any(u.find_spec(n) for n in ('addon', 'scripts', 'watchers'))\n"
    )
    assert (
        subprocess.run([sys.executable, "-P", "-c", alone], cwd=tmp_path, env=env).returncode == 0
    )
    for command in ("run", "status", "doctor", "watch", "stress", "services", "guard"):
        said = installed(command, "--help")
        assert said.returncode == 0 and "usage: spillover" in said.stdout, (command, said.stderr)
    listed = installed("options")  # the addon's own declarations, loaded from the package
    assert listed.returncode == 0 and "spillover_fallbacks  (str" in listed.stdout, listed.stderr


def test_a_fresh_venv_from_the_wheel_runs_every_command(
    built: Built, tmp_path: Path, start_server, fallback, server_logs: Path
) -> None:
    """As a user installs it: a new virtual environment, the wheel and its dependencies
    from the package index (not numpy: gguf is an extra), then every command from that
    environment: `run --workers 2` behind HAProxy with a handoff, `status`, `watch`,
    `stress`, `services install` into a temporary place, `guard`, `doctor`, and
    `mitmdump -s "$(spillover addon-path)"` with a handoff."""
    if (why := haproxy_missing()) is not None:
        pytest.skip(why)
    wheel = built.wheel
    fresh = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", fresh], check=True)
    bin_dir = fresh / "bin"
    pip = [bin_dir / "python", "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "install", wheel], check=True, timeout=600)
    assert subprocess.run([bin_dir / "python", "-c", "import numpy"]).returncode != 0

    def spillover(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([bin_dir / "spillover", *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip

    doctor = spillover("doctor")
    assert doctor.returncode == 0 and "memory sources" in doctor.stdout, doctor.stderr
    stress = spillover("stress", "ram", "--step-mib", "16", "--steps", "1", "--hold-s", "0")
    assert stress.returncode == 0 and "ram:" in stress.stdout, stress.stderr
    units = tmp_path / "units"
    installed = spillover(
        "services", "install", "--primary", "http://127.0.0.1:8081", "--config-dir",
        str(tmp_path / "etc"), "--unit-dir", str(units), "--no-start",
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    assert f"ExecStart={bin_dir}/spillover run" in (units / "spillover-proxy.service").read_text()
    assert f"ExecStart={bin_dir}/spillover guard" in (units / "spillover-guard.service").read_text()

    primary = start_server("primary")
    port = free_port()
    workers = subprocess.Popen(
        [bin_dir / "spillover", "run", "--primary", primary.url, "--fallbacks", fallback.url,
         "--workers", "2", "--port", str(port)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    proxy = f"http://127.0.0.1:{port}"
    try:
        said = ""
        assert workers.stdout is not None
        while "2 workers up behind HAProxy" not in said:
            line = workers.stdout.readline()
            assert line, said
            said += line
        with Throttled(primary.pid):  # (a full run found the whole answer written first)
            stream = read_stream(
                proxy, chat_body(200), on_chunk=lambda n: n == 30 and primary.kill()
            )
        assert_one_clean_stream(stream)
        assert f"{primary.url} -> {fallback.url}" in stream.notes[0]
        status = spillover("status", "--proxy", proxy, "--json")
        assert status.returncode == 0 and json.loads(status.stdout)["fallbacks"] == [fallback.url]
        shown = on_a_terminal([str(bin_dir / "spillover"), "watch", "--proxy", proxy])
        assert fallback.url in shown, shown
    finally:
        workers.terminate()
        workers.wait(timeout=30)

    again = start_server("primary")
    addon = Path(spillover("addon-path").stdout.strip())
    assert addon.is_relative_to(fresh)
    proxy = Mitmdump(again.url, [fallback.url], log_dir=server_logs, addon_path=addon,
                     mitmdump=bin_dir / "mitmdump").start()  # fmt: skip
    try:
        with Throttled(again.pid):
            stream = read_stream(
                proxy.url, chat_body(200), on_chunk=lambda n: n == 30 and again.kill()
            )
        assert_one_clean_stream(stream)
        assert f"{again.url} -> {fallback.url}" in stream.notes[0]
    finally:
        proxy.stop()
    guard = spillover("guard", "--help")
    assert guard.returncode == 0 and "--primary PRIMARY" in guard.stdout
