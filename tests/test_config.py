"""`spillover run --config FILE.yaml`, and every wrong input named in one line before
anything starts: by the installed `spillover` command (this venv's), and by the addon's
own option checks under a plain `mitmdump -s`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from mitmproxy.optmanager import parse

from scripts.parts.config import read
from scripts.parts.options import declared
from scripts.parts.processes import free_port
from scripts.testbed.mitm import Mitmdump
from tests.streams import assert_one_clean_stream, chat_body, read_stream

REPO = Path(__file__).resolve().parent.parent
SPILLOVER = Path(sys.executable).parent / "spillover"
A, B = "http://127.0.0.1:8081", "http://127.0.0.1:8082"  # nothing needs to answer there


def spillover(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SPILLOVER, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )  # fmt: skip


def refused(said: subprocess.CompletedProcess[str]) -> str:
    """The one line `run` said when it refused to start (status 2, nothing else said)."""
    assert said.returncode == 2 and said.stdout == "", said
    assert said.stderr.count("\n") == 1 and "Traceback" not in said.stderr, said.stderr
    return said.stderr.removeprefix("spillover run: ").rstrip("\n")


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--primary", "127.0.0.1:8081"],
         "primary 127.0.0.1:8081 has no scheme: did you mean http://127.0.0.1:8081?"),
        (["--primary", f"{A}/v1"],
         f"primary {A}/v1: drop the /v1 (give {A}): the proxy serves the server's own paths, "
         "so clients keep theirs"),
        (["--primary", A, "--fallbacks", "ftp://127.0.0.1:8082"],
         "fallback ftp://127.0.0.1:8082: the scheme is ftp://, not http:// or https://"),
        (["--primary", A, "--fallbacks", "http://localhost:8081/"],
         "fallback http://localhost:8081/ is the primary again: a fallback is another server"),
        (["--primary", A, "--fallbacks", f"{B},http://0.0.0.0:8082"],
         f"fallback http://0.0.0.0:8082 is the fallback {B} again: a fallback is another "
         "server"),
        (["--primary", "http://localhost:8090"],
         "primary http://localhost:8090 is this proxy's own address (127.0.0.1:8090): it "
         "would send answers to itself"),
        (["--primary", A, "--fallbacks", "http://127.0.0.1:9000", "--listen-host", "0.0.0.0",
          "--port", "9000"],
         "fallback http://127.0.0.1:9000 is this proxy's own address (0.0.0.0:9000): it "
         "would send answers to itself"),
        (["--primary", A, "--port", "70000"], "port 70000 is not a port (0 to 65535)"),
        ([], "run needs --primary (or a --config file that names it)"),
    ],
)  # fmt: skip
def test_a_wrong_server_is_named_in_one_line(flags: list[str], line: str) -> None:
    assert refused(spillover("run", *flags)) == line


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("primary: http://127.0.0.1:8081\nfree_flor_mib: 256\n",
         "unknown key free_flor_mib; did you mean free_floor_mib?"),
        ("primary: http://127.0.0.1:8081\nspillover_stal_s: 30\n",
         "unknown key spillover_stal_s; did you mean spillover_stall_s?"),
        ("primary: http://127.0.0.1:8081\nprot: 8090\n", "unknown key prot; did you mean port?"),
        ("primary: http://127.0.0.1:8081\nfree_floor_mib: 1.5\n",
         "free_floor_mib is a whole number, not 1.5"),
        ("primary: http://127.0.0.1:8081\nhand_back: maybe\n",
         "hand_back is true or false, not 'maybe'"),
        ("primary: http://127.0.0.1:8081\nstall_s: 9\nspillover_stall_s: 9\n",
         "spillover_stall_s is given twice (as stall_s too)"),
        ("primary: http://127.0.0.1:8081\nspillover_primary: http://127.0.0.1:8081\n",
         "spillover_primary is given twice (as primary too)"),
        ("primary: http://127.0.0.1:8081\nfallbacks: {a: b}\n",
         "fallbacks is a list of URLs (or one comma-separated string)"),
        ("- http://127.0.0.1:8081\n", "not a YAML mapping of keys (primary: URL, ...)"),
    ],
)  # fmt: skip
def test_a_mistake_in_the_config_file_is_named_in_one_line(
    text: str, line: str, tmp_path: Path
) -> None:
    (tmp_path / "spillover.yaml").write_text(text)
    assert refused(spillover("run", "--config", "spillover.yaml", cwd=tmp_path)) == (
        f"spillover.yaml: {line}"
    )


WRONG_KEYS = (
    "primary: http://127.0.0.1:8081\nport: 8090\nflow_detail: 1\nfree_flor_mib: 256\n"
    "web_port: 8070\nlisten_port: 9000\n"
)
EACH_WRONG_KEY = [
    "unknown key free_flor_mib; did you mean free_floor_mib?",
    "unknown key web_port: mitmweb's option (or the console's), and spillover run starts mitmdump",
    "listen_port: the port is port here",
]


@pytest.mark.parametrize(
    ("command", "said_by"),
    [
        (["run"], "spillover run"), (["status"], "spillover status"), (["watch"], "watch"),
        (["doctor"], "doctor"), (["stress", "gpu"], "stress"),
        (["services", "install", "--no-start"], "services"),
    ],
)  # fmt: skip
def test_every_command_refuses_a_wrong_key_in_the_settings_file(
    command: list[str], said_by: str, tmp_path: Path
) -> None:
    """One file for every command, read alike: each wrong key in one line, exit status 2,
    nothing done (mitmdump's own flow_detail is a key like any other); the file named
    by --config, or ./spillover.yaml found by itself, which the command then says."""
    config = tmp_path / "spillover.yaml"
    config.write_text(WRONG_KEYS)
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "home")}  # (for services)
    for named, shown, first in (
        (["--config", str(config)], config, []),
        ([], Path("spillover.yaml"), [f"{said_by}: settings from {config}"]),
    ):
        said = spillover(*command, *named, cwd=tmp_path, env=env)
        assert said.returncode == 2 and said.stdout == "", said
        assert said.stderr.splitlines() == first + [
            f"{said_by}: {shown}: {line}" for line in EACH_WRONG_KEY
        ]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["spillover.yaml"]


def test_what_the_file_names_is_checked_as_the_flags_are(tmp_path: Path) -> None:
    config = tmp_path / "spillover.yaml"
    config.write_text("primary: http://127.0.0.1:8081\nfallbacks:\n  - 127.0.0.1:8082\n")
    line = "fallback 127.0.0.1:8082 has no scheme: did you mean http://127.0.0.1:8082?"
    assert refused(spillover("run", "--config", str(config))) == line
    config.write_text("fallbacks: http://127.0.0.1:8082\n")
    line = f"{config} names no primary (primary: http://HOST:PORT), nor --primary"
    assert refused(spillover("run", "--config", str(config))) == line
    missing = tmp_path / "nowhere.yaml"
    assert refused(spillover("run", "--config", str(missing))) == (
        f"--config {missing}: No such file or directory"
    )


def test_a_confdir_that_names_no_primary_is_refused(tmp_path: Path) -> None:
    """(Started, mitmdump would be a plain forward proxy there, carrying nothing.)"""
    said = refused(spillover("run", "--confdir", str(tmp_path)))
    assert said == (
        f"--confdir {tmp_path}: no config.yaml to name the primary (No such file or "
        "directory): give --primary or --config"
    )
    (tmp_path / "config.yaml").write_text("flow_detail: 0\nspillover_fallbacks: ''\n")
    assert refused(spillover("run", "--confdir", str(tmp_path))) == (
        f"{tmp_path / 'config.yaml'} names no primary (mode: [reverse:URL] or "
        "spillover_primary): give --primary or --config"
    )


@pytest.mark.parametrize(
    ("primary", "fallbacks", "options", "line"),
    [
        ("127.0.0.1:{free}", [], [],
         "primary 127.0.0.1:{free} has no scheme: did you mean http://127.0.0.1:{free}?"),
        ("http://127.0.0.1:{free}", ["http://127.0.0.1:{free}/v1"], [],
         "fallback http://127.0.0.1:{free}/v1: drop the /v1 (give http://127.0.0.1:{free}): "
         "the proxy serves the server's own paths, so clients keep theirs"),
        ("http://127.0.0.1:{free}", [], ["spillover_primary=http://localhost:{port}"],
         "primary http://localhost:{port} is this proxy's own address (127.0.0.1:{port}): it "
         "would send answers to itself"),
    ],
)  # fmt: skip
def test_the_addon_names_a_wrong_server_itself(
    primary: str, fallbacks: list[str], options: list[str], line: str
) -> None:
    """`mitmdump -s addon/spillover.py` as a person runs it: the addon's option check says
    the same line, and mitmproxy ends with status 1 before any answer is carried."""
    values = {"free": free_port(), "port": free_port()}
    proxy = Mitmdump(
        primary.format(**values), [url.format(**values) for url in fallbacks],
        options=[option.format(**values) for option in options], port=values["port"],
    )  # fmt: skip
    run = subprocess.run(proxy.argv(), capture_output=True, text=True, timeout=60)
    said = run.stdout + run.stderr
    assert run.returncode == 1, said
    assert f"spillover: {line.format(**values)}\n" in said and "Traceback" not in said, said


class ConfigRun(Mitmdump):
    """The proxy as a user starts it from a file: `spillover run --config FILE` and the
    flags and mitmdump arguments given besides."""

    def __init__(self, config: Path, primary: str, fallbacks: list[str], args: list[str],
                 **kwargs) -> None:  # fmt: skip
        super().__init__(primary, fallbacks, **kwargs)
        self.config, self.args = config, args

    def argv(self) -> list[str]:
        run = [str(SPILLOVER), "run", "--config", str(self.config), "--port", str(self.port)]
        return [*run, *self.args]


def yaml_blocks(page: str) -> list[str]:
    """The config files a page shows (its YAML blocks that name a primary)."""
    blocks = re.findall(r"```yaml\n(.*?)```", (REPO / page).read_text(), re.S)
    return [block for block in blocks if re.search(r"^primary:", block, re.M)]


def test_the_config_files_in_the_docs_are_read_as_written(tmp_path: Path) -> None:
    blocks = yaml_blocks("README.md") + yaml_blocks("docs/running.md")
    assert len(blocks) >= 2
    known = declared()
    for at, block in enumerate(blocks):
        (path := tmp_path / f"{at}.yaml").write_text(block)
        config = read(path, known)
        assert config.settings["primary"] and config.settings["fallbacks"] and config.options


def test_a_proxy_from_the_readmes_config_file_carries_an_answer_across_a_handoff(
    start_server, fallback, server_logs: Path, tmp_path: Path
) -> None:
    """The README's file with the test's servers: the fallbacks a YAML list, a port that
    the flag overrides, an option without the prefix; and one with it, mitmdump's own
    flow_detail, and an option after `--` that wins over the file's value of it (rather
    than be refused as given twice)."""
    primary = start_server("primary")
    (readme,) = yaml_blocks("README.md")
    named = parse(readme)
    (their_fallback,) = named["fallbacks"]
    text = readme.replace(named["primary"], primary.url).replace(their_fallback, fallback.url)
    config = tmp_path / "spillover.yaml"
    config.write_text(f"{text}interval_ms: 40\nspillover_stall_s: 25\nflow_detail: 0\n")
    args = ["--", "--set", "spillover_interval_ms=60"]
    proxy = ConfigRun(config, primary.url, [fallback.url], args, log_dir=server_logs)
    assert f"port: {proxy.port}\n" not in text  # the flag's port is another
    proxy.start(timeout=60)
    try:
        proxy.servers_known()
        status = httpx.get(f"{proxy.url}/spillover/status").json()
        assert status["fallbacks"] == [fallback.url]
        assert status["memory"]["interval_ms"] == 60, status["memory"]  # `--` wins
        argv = Path(f"/proc/{proxy.pid}/cmdline").read_bytes().split(b"\0")
        assert b"spillover_stall_s=25" in argv and b"spillover_interval_ms=40" not in argv
        assert b"flow_detail=0" in argv  # mitmdump's own option, from the file
        stream = read_stream(
            proxy.url, chat_body(200), on_chunk=lambda n: n == 30 and primary.kill()
        )
        assert_one_clean_stream(stream)
        assert f"{primary.url} -> {fallback.url}" in stream.notes[0]
        summary = spillover("status", "--proxy", proxy.url)
        assert summary.returncode == 0, summary.stderr
        said = summary.stdout
        assert f"  {fallback.url} (fallback): ok;" in said, said
        assert f"failure {primary.url} -> {fallback.url} after " in said, said
    finally:
        proxy.stop()
