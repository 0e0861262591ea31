"""The `spillover` command: `run` starts a working proxy without the addon's path, and
each tool answers under it (a real mitmdump, real llama-servers)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from scripts.testbed.mitm import SpilloverRun
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


def test_the_wheel_installs_one_package_and_its_command_runs(tmp_path: Path) -> None:
    """The wheel pip builds from this checkout, installed (without its dependencies,
    which this venv has) into a folder of its own: one top-level package, `spillover`;
    `addon`, `scripts` and `watchers` are not importable beside it, yet its command runs
    the tools."""
    wheels, target, source = tmp_path / "wheels", tmp_path / "site", tmp_path / "source"
    # From the files a clone has (a checkout's egg-info would add what the package list
    # lacks).
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
        text=True, check=True,
    ).stdout.split()  # fmt: skip
    for name in listed:
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", wheels, source], check=True, timeout=300)
    (wheel,) = wheels.glob("spillover-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"spillover", wheel.name.removesuffix("-py3-none-any.whl") + ".dist-info"}
    subprocess.run([*pip, "install", "--no-deps", "--target", target, wheel], check=True)
    probe = (
        "import importlib.util as u, sys\n"
        "assert not any(u.find_spec(n) for n in ('addon', 'scripts', 'watchers'))\n"
        "import spillover\n"
        "print(spillover.__file__)\n"
        # What `spillover run --workers N` imports, found as the command finds it.
        "root = u.find_spec('spillover.addon').origin.rsplit('/', 2)[0]\n"
        "sys.path.insert(0, root)\n"
        "import scripts.workers.pool\n"
        "sys.path.remove(root)\n"
        "sys.argv = ['spillover', 'doctor', '--help']\n"
        "spillover.main()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    said = subprocess.run(
        [sys.executable, "-P", "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert said.returncode == 0, said.stderr
    assert said.stdout.startswith(str(target / "spillover" / "__init__.py")), said.stdout
    assert "usage: spillover doctor" in said.stdout
