"""Options that name servers by URL find their server however its URL is spelled, and one
that names none of the proxy's servers is refused at start in one line: real
llama-servers (one wants an API key) behind a real mitmdump with the addon, `spillover
run` and the doctor, and a sysfs tree standing in for the cards."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from scripts.parts.processes import free_port
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.memfiles import FakeCard
from scripts.testbed.mitm import Mitmdump
from tests.streams import assert_one_clean_stream, chat_body, read_stream
from tests.test_credentials import stream_with
from tests.test_services import without_systemd

REPO = Path(__file__).resolve().parent.parent
SPILLOVER = Path(sys.executable).parent / "spillover"
KEY = "fallback-key-53c1"
LONG = 800
# A fallback that nothing answers, named without its port: http's own, 80.
UNPORTED = "http://127.0.0.1"


@pytest.fixture(scope="module")
def keyed(start_server_module) -> LlamaServer:
    """A fallback that turns away whoever does not bring its key."""
    return start_server_module("fallback", extra_args=["--api-key", KEY])


def test_each_option_finds_its_server_however_its_url_is_spelled(
    start_proxy, primary: LlamaServer, keyed: LlamaServer, tmp_path: Path
) -> None:
    """The primary is http://127.0.0.1:PORT; the options name it, the keyed fallback and a
    fallback given without a port as localhost, with a trailing slash, in capitals, with
    spaces around entries, with the default port written out. Each finds its server: the
    cards are watched (a step on the primary's hands its answer off), the key lets the
    addon ask the fallback and carry the answer there, the model, the template file and
    the declared way are the servers' own."""
    sysfs = tmp_path / "sys"
    card0 = FakeCard(sysfs, "card0", total_mib=16384, used_mib=10000)
    FakeCard(sysfs, "card1", total_mib=8192, used_mib=2000)
    FakeCard(sysfs, "card2", total_mib=8192, used_mib=2000)
    p, f = primary.port, keyed.port
    options = [
        f"spillover_sysfs_root={sysfs}", "spillover_sources=sysfs",
        f"spillover_cards= http://localhost:{p}/=drm:card0, http://127.0.0.1:{f}/ = drm:card1,"
        "http://localhost:80=drm:card2",
        f"spillover_server_keys=http://LOCALHOST:{f}={KEY}",
        "spillover_models=http://localhost:80/=named-model",
        f"spillover_templates= http://localhost/={primary.model}",
        f"spillover_continue_by={UNPORTED}:80/=message",
    ]  # fmt: skip
    proxy = start_proxy(primary.url, [keyed.url, UNPORTED], options=options)
    status = httpx.get(f"{proxy.url}/spillover/status").json()
    memory = status["memory"]["servers"]
    on = {primary.url: "drm:card0", keyed.url: "drm:card1", UNPORTED: "drm:card2"}
    for url, card in on.items():
        assert (memory[url]["cards"], memory[url]["how"]) == ([card], "explicit"), memory
    servers = proxy.servers_known()
    assert not servers[keyed.url]["wants_key"] and servers[keyed.url]["slot_context"]
    assert servers[UNPORTED]["model"] == "named-model"
    assert servers[UNPORTED]["template_from"], servers[UNPORTED]
    assert servers[UNPORTED]["declared"] == "message"

    stream = read_stream(
        proxy.url, chat_body(LONG), on_chunk=lambda n: n == 20 and card0.set_used(15041)
    )
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert "memory pressure on drm:card0" in note and keyed.url in note, note
    assert len(stream.segments) == 2 and all(stream.segments)


def test_forwarded_credentials_follow_their_server_however_its_url_is_spelled(
    start_proxy, keyed: LlamaServer
) -> None:
    """The primary is down, so a new answer may start only on the keyed fallback, and only
    where the client's own key goes there (the owner's serves clients the primary let in):
    named as localhost, with a slash and spaces, it does, and the answer is written."""
    options = [f"spillover_forward_credentials= http://localhost:{keyed.port}/ "]
    proxy = start_proxy(f"http://127.0.0.1:{free_port()}", [keyed.url], options=options)
    proxy.servers_known()
    stream = stream_with(proxy.url, {"authorization": f"Bearer {KEY}"})
    assert_one_clean_stream(stream)
    assert stream.text, stream


A, B = "http://127.0.0.1:8081", "http://127.0.0.1:8082"  # nothing needs to answer there
WRONG = "http://127.0.0.1:8018"
NAMES_NONE = f"names no server here (servers: {A}, {B})"
# Each option that names servers, with a value, naming a port no server has.
WRONG_PORT = {
    "spillover_cards": "=nvml:0", "spillover_remote_cards": '={gpu="0"}',
    "spillover_server_keys": "=k", "spillover_forward_credentials": "",
    "spillover_models": "=m", "spillover_templates": "=/t.gguf",
    "spillover_continue_by": "=message",
}  # fmt: skip
MISTAKES = [
    *((f"{name}={WRONG}{value}", f"{name}: {WRONG} {NAMES_NONE}")
      for name, value in WRONG_PORT.items()),
    ("spillover_cards=https://127.0.0.1:8081=nvml:0",
     f"spillover_cards: https://127.0.0.1:8081 {NAMES_NONE}"),
    ("spillover_cards=127.0.0.1:8081=nvml:0",
     "spillover_cards: 127.0.0.1:8081 has no scheme: did you mean http://127.0.0.1:8081?"),
    ("spillover_models=http://localhost:8082=a,http://127.0.0.1:8082/=b",
     f"spillover_models: http://localhost:8082 and http://127.0.0.1:8082 are one server, {B}: "
     "name it once"),
]  # fmt: skip
IDS = [*WRONG_PORT, "another scheme", "no scheme", "one server twice"]


@pytest.mark.parametrize(("option", "line"), MISTAKES, ids=IDS)
def test_an_entry_that_names_no_server_is_refused_by_the_addon(option: str, line: str) -> None:
    """`mitmdump -s addon/spillover.py` as a person runs it: one line, status 1."""
    proxy = Mitmdump(A, [B], options=[option], port=free_port())
    run = subprocess.run(proxy.argv(), capture_output=True, text=True, timeout=60)
    said = run.stdout + run.stderr
    assert run.returncode == 1, said
    assert f"spillover: {line}\n" in said and "Traceback" not in said, said


@pytest.mark.parametrize(("option", "line"), MISTAKES, ids=IDS)
def test_an_entry_that_names_no_server_is_refused_by_run(
    option: str, line: str, tmp_path: Path
) -> None:
    """`spillover run` says it before mitmdump starts: one line, status 2."""
    run = [str(SPILLOVER), "run", "--primary", A, "--fallbacks", B, "--", "--set", option]
    said = subprocess.run(run, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert (said.returncode, said.stdout, said.stderr) == (2, "", f"spillover run: {line}\n")


def test_a_settings_files_entry_that_names_no_server_is_refused_by_run(tmp_path: Path) -> None:
    (tmp_path / "spillover.yaml").write_text(
        f"primary: {A}\nfallbacks: [{B}]\ncards: {WRONG}=nvml:0\n"
    )
    run = [str(SPILLOVER), "run", "--config", "spillover.yaml"]
    said = subprocess.run(run, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    line = f"spillover run: spillover_cards: {WRONG} {NAMES_NONE}\n"
    assert (said.returncode, said.stdout, said.stderr) == (2, "", line)


def test_services_install_refuses_what_run_would(tmp_path: Path) -> None:
    """The units run `spillover run --config FILE`, which would refuse to start: install
    says so first, in run's own line, and writes nothing (the stand-in `systemctl` is
    never reached)."""
    env = without_systemd(tmp_path)
    settings = tmp_path / "settings.yaml"
    settings.write_text(f"primary: {A}\nfallbacks: [{B}]\ncards: {WRONG}=nvml:0\n")
    ports = ["--listen", f"127.0.0.1:{free_port()}", "--proxy-port", str(free_port())]
    for flags, line in (
        (["--config", str(settings)], f"spillover_cards: {WRONG} {NAMES_NONE}"),
        (["--primary", "127.0.0.1:8081"],
         "primary 127.0.0.1:8081 has no scheme: did you mean http://127.0.0.1:8081?"),
    ):  # fmt: skip
        run = subprocess.run(
            [sys.executable, "-m", "scripts.services", "install", *flags, *ports],
            cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        )  # fmt: skip
        assert (run.returncode, run.stderr) == (1, f"services: {line}\n"), run
    assert not (tmp_path / "config").exists()


def doctor(*args: str) -> subprocess.CompletedProcess[str]:
    run = [sys.executable, "-m", "scripts.doctor", *args]
    return subprocess.run(run, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_the_doctor_matches_cards_to_servers_as_the_proxy_does(
    primary: LlamaServer, tmp_path: Path
) -> None:
    sysfs = tmp_path / "sys"
    FakeCard(sysfs, "card0", total_mib=16384, used_mib=10000)
    common = ["--sysfs-root", str(sysfs), "--servers", primary.url]
    wrong = doctor(*common, "--cards", f"http://127.0.0.1:{free_port()}=drm:card0")
    assert wrong.returncode == 2 and wrong.stdout == "", wrong
    assert wrong.stderr.endswith(f"names no server here (servers: {primary.url})\n"), wrong
    right = doctor(*common, "--cards", f" http://localhost:{primary.port}/=drm:card0")
    assert right.returncode == 0, right.stdout + right.stderr
    assert "cards: drm:card0 (by explicit: spillover_cards)" in right.stdout


@pytest.mark.parametrize(
    ("command", "said"),
    [
        (["run", "--primary", "127.0.0.1:8090"], "spillover run: primary"),
        (["doctor", "--servers", "127.0.0.1:8090"], "doctor: primary"),
        (["status", "--proxy", "127.0.0.1:8090"], "spillover status: proxy"),
        (["watch", "--proxy", "127.0.0.1:8090"], "watch: proxy"),
    ],
    ids=["run", "doctor", "status", "watch"],
)
def test_a_url_without_a_scheme_gets_one_answer_from_every_command(
    command: list[str], said: str, tmp_path: Path
) -> None:
    run = subprocess.run(
        [str(SPILLOVER), *command], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    line = f"{said} 127.0.0.1:8090 has no scheme: did you mean http://127.0.0.1:8090?\n"
    assert (run.returncode, run.stdout, run.stderr) == (2, "", line)
