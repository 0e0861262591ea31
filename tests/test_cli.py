"""The `spillover` command: `run` starts a working proxy without the addon's path, and
each tool answers under it (a real mitmdump, real llama-servers)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from scripts.testbed.mitm import Mitmdump, SpilloverRun
from tests.streams import assert_one_clean_stream, chat_body, read_stream

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
    for both, said in (
        (["--capture", "x", "--workers", "2"], "--capture runs one proxy (not --workers)"),
        (["--transparent", "--capture", "x"], "not allowed with argument"),
    ):
        wrong = spillover("run", "--primary", "http://127.0.0.1:9", *both)
        assert wrong.returncode == 2 and said in wrong.stderr, wrong.stderr
    nobody = spillover("status", "--proxy", "http://127.0.0.1:9")
    assert nobody.returncode == 1 and "no proxy at http://127.0.0.1:9" in nobody.stderr


def built_wheel(tmp_path: Path) -> Path:
    """The wheel pip builds from the files a clone has (a checkout's egg-info would add
    what the package list lacks)."""
    wheels, source = tmp_path / "wheels", tmp_path / "source"
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
        text=True, check=True,
    ).stdout.split()  # fmt: skip
    for name in listed:
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    subprocess.run([*PIP, "wheel", "--no-deps", "-w", wheels, source], check=True, timeout=300)
    (wheel,) = wheels.glob("spillover-*.whl")
    return wheel


PIP = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
TEST_BED = re.compile(r"^\s*(from|import) scripts\.(testbed|bench|gpu)\b", re.MULTILINE)


def test_the_wheel_installs_one_package_and_its_commands_run(
    tmp_path: Path, start_server, fallback, server_logs: Path
) -> None:
    """The wheel, installed (without its dependencies, which this venv has) into a folder
    of its own: one top-level package, `spillover`, with its license and without the test
    bed, the benchmarks or the GPU proof (nothing in it imports them); `addon`, `scripts`
    and `watchers` are not importable beside it, yet its command runs every tool, and
    `mitmdump -s "$(spillover addon-path)"` is a working proxy: a real primary killed
    mid-answer, the fallback goes on."""
    wheel = built_wheel(tmp_path)
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
    doctor = installed("doctor")
    assert doctor.returncode == 0 and "llama-server on this machine" in doctor.stdout, doctor.stderr
    # What `spillover run --workers N` imports, found as the command finds it.
    pool = (
        "import importlib.util as u, sys\n"
        "sys.path.insert(0, u.find_spec('spillover.addon').origin.rsplit('/', 2)[0])\n"
        "import scripts.workers.pool\n"
    )
    imported = subprocess.run([sys.executable, "-P", "-c", pool], cwd=tmp_path, env=env,
                              capture_output=True, text=True)  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    path = Path(installed("addon-path").stdout.strip())
    assert path == target / "spillover" / "addon" / "spillover.py"

    primary = start_server("primary")
    proxy = Mitmdump(primary.url, [fallback.url], log_dir=server_logs, addon_path=path).start()
    try:
        stream = read_stream(
            proxy.url, chat_body(200), on_chunk=lambda n: n == 30 and primary.kill()
        )
        assert_one_clean_stream(stream)
        assert f"{primary.url} -> {fallback.url}" in stream.notes[0]
    finally:
        proxy.stop()
