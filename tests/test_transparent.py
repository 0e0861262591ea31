"""Clients that change nothing: `spillover run --transparent` has the kernel send the
primary's connections to the proxy (mitmproxy's transparent mode, nftables rules held by
the proxy's process), and nothing is left when the proxy goes.

Everything runs in two network namespaces the test makes (a server side, where the
servers, the proxy and its rules live, and a client side joined to it by a veth link,
as a container is to its host): the machine's own traffic and rules are never touched.
The clients are unmodified curl processes that name the server's own address and port,
over IPv4 and IPv6: from the other namespace (their connections pass the server side's
prerouting hook), and on the server side as another user (the output hook; the proxy's
own user is exempt there, so the proxy still reaches the server).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from addon.surface.nftables import owner_tables_work
from scripts.doctor import CGROUP_ROOT, cgroup2_mount, local_capture_why_not
from scripts.parts.processes import ServerFailed, free_port
from scripts.testbed import netns
from scripts.testbed.mitm import REPO, SpilloverRun
from scripts.testbed.netns import SERVER_ADDRESS, SERVER_ADDRESS6, Netns
from scripts.testbed.prompts import chat_body
from scripts.testbed.workers import SpilloverWorkers, haproxy_missing
from tests.conftest import SHADOW_OFF
from tests.streams import (
    RawStream,
    assert_exact_splice,
    assert_one_clean_stream,
    direct_text,
    record,
)
from tests.throttle import Throttled

MAX_TOKENS = 400
ASK_AT = 5
NOBODY = "65534"


def _why_skip() -> str | None:
    if why := netns.why_not():
        return why
    return owner_tables_work()


pytestmark = pytest.mark.skipif(bool(_why_skip()), reason=_why_skip() or "")


def asking_handoff(
    control: httpx.Client, proxy: SpilloverRun | SpilloverWorkers, throttled: Throttled
):
    """`on_chunk` for a stream from the throttled primary: ask the proxy for a handoff at the
    `chunks`-th chunk, with the primary stopped, and check one answer moved. (Not
    test_splice's `handoff_after`: its client is shared with tests outside the
    namespaces, and could reuse a connection opened there.)"""

    def handoff_at(chunks: int):
        def on_chunk(n: int) -> None:
            if n == chunks:
                with throttled.held():
                    reply = control.post(f"{proxy.url}/spillover/handoff", json={})
                    moved = reply.json()["handed_off"]
                    assert moved == 1, f"{reply.text}; the proxy's log:\n{proxy_log(proxy)}"

        return on_chunk

    return handoff_at


def proxy_log(proxy: SpilloverRun | SpilloverWorkers) -> str:
    """The proxy's last lines, without the redirector's verifier dumps."""
    lines = proxy.log_path.read_text(errors="replace").splitlines()
    return "\n".join([line for line in lines if "]     " not in line[:20]][-25:])


@pytest.fixture
def sides() -> Iterator[tuple[Netns, Netns]]:
    server, client = Netns.pair()
    yield server, client
    server.delete()
    client.delete()


def curl_stream(command: list[str], url: str, on_chunk, curl: str = "curl") -> RawStream:
    """Stream a chat completion with curl (started by `command`: a namespace, a user)."""
    body = json.dumps(chat_body(MAX_TOKENS))
    client = subprocess.Popen(
        [*command, curl, "-sSN", "--max-time", "60", "-H", "content-type: application/json",
         "-d", body, f"{url}/v1/chat/completions"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    stream = RawStream()
    assert client.stdout is not None
    for line in client.stdout:
        record(stream, line.rstrip("\n"))
        if line.startswith("data: {"):
            on_chunk(len(stream.chunks))
    assert client.wait() == 0, client.stderr.read() if client.stderr else ""
    stream.status = 200
    return stream


def test_clients_that_keep_the_servers_url_get_a_handed_off_answer_until_the_proxy_goes(
    sides, start_server, server_logs
) -> None:
    server_side, client_side = sides
    from_container = ["ip", "netns", "exec", client_side.name]
    as_other_user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    with server_side.inside():
        # The primary listens on every address of its side, both families, as a server
        # that containers reach does; the proxy names it by one of them.
        primary = start_server("primary", host="::", port=free_port("::"))
        fallback = start_server("fallback")
        named = f"http://{SERVER_ADDRESS}:{primary.port}"
        clients = [  # (how started, the URL it names: the server's own, before and after)
            (from_container, named),
            (from_container, f"http://[{SERVER_ADDRESS6}]:{primary.port}"),
            (as_other_user, named),
            (as_other_user, f"http://[::1]:{primary.port}"),
        ]
        proxy = SpilloverRun(
            named, [fallback.url], ["--transparent"], log_dir=server_logs, options=SHADOW_OFF
        ).start()
        control = httpx.Client()

        assert f"tcp dport {primary.port} redirect to :" in server_side.nft_ruleset()
        for client, url in clients:
            with Throttled(primary.pid) as throttled:
                stream = curl_stream(client, url, asking_handoff(control, proxy, throttled)(ASK_AT))
            assert_one_clean_stream(stream)
            assert len(stream.segments) == 2, (client, url, stream.notes)
            assert_exact_splice(stream, named, fallback.url, MAX_TOKENS)

        # Stopped, the proxy leaves no rule: the same clients reach the server itself.
        proxy.stop()
        assert "spillover" not in server_side.nft_ruleset()
        for client, url in clients:
            stream = curl_stream(client, url, lambda n: None)
            assert not stream.notes and stream.done == 1, (url, stream.notes)

        # Killed, likewise: the kernel drops the rules with the proxy's process.
        proxy = SpilloverRun(
            named, [fallback.url], ["--transparent"], log_dir=server_logs, options=SHADOW_OFF
        ).start()
        assert "spillover" in server_side.nft_ruleset()
        os.kill(proxy.pid, signal.SIGKILL)
        proxy.process.wait()
        assert "spillover" not in server_side.nft_ruleset()
        for client, url in clients:
            stream = curl_stream(client, url, lambda n: None)
            assert stream.done == 1 and len(stream.segments) == 1, url
        proxy.stop()
        control.close()


def _why_no_local_capture() -> str | None:
    """Why mitmproxy's local capture cannot run here, even in a mount namespace of the
    test's with the cgroup v2 hierarchy where its redirector looks for it."""
    why = local_capture_why_not()
    return None if why is None or (why.startswith("the redirector") and cgroup2_mount()) else why


@pytest.mark.skipif(bool(_why_no_local_capture()), reason=_why_no_local_capture() or "")
def test_local_capture_takes_a_named_programs_connections_until_the_proxy_goes(
    sides, start_server, server_logs, tmp_path
) -> None:
    """`spillover run --capture PROGRAM`: mitmproxy's local mode takes the connections of
    that program only, whichever user runs it (here the proxy's own, which the transparent
    mode's rules must exempt). The program is a copy of curl under a name of this test's:
    the redirector's eBPF programs see every process of the machine by name."""
    server_side, _ = sides
    program = tmp_path / f"spc{secrets.token_hex(4)}"
    shutil.copy(shutil.which("curl") or "/usr/bin/curl", program)
    # On a hybrid cgroup layout the v2 hierarchy is elsewhere: the proxy gets a mount
    # namespace of its own with it where the redirector looks (the doctor says so).
    prefix = [] if cgroup2_mount() == CGROUP_ROOT else [
        "unshare", "--mount", "sh", "-c",
        f'mount -t cgroup2 none {CGROUP_ROOT} && exec "$0" "$@"',
    ]  # fmt: skip
    with server_side.inside():
        primary = start_server("primary")
        fallback = start_server("fallback")
        proxy = SpilloverRun(  # -v: its log's connection lines count what it takes
            primary.url, [fallback.url], ["--capture", program.name, "-v"], prefix=prefix,
            log_dir=server_logs, options=SHADOW_OFF,
        ).start()  # fmt: skip
        control = httpx.Client()
        with Throttled(primary.pid) as throttled:
            stream = curl_stream([], primary.url, asking_handoff(control, proxy, throttled)(ASK_AT),
                                 curl=str(program))  # fmt: skip
        assert_one_clean_stream(stream)
        assert len(stream.segments) == 2, stream.notes
        assert_exact_splice(stream, primary.url, fallback.url, MAX_TOKENS)
        # The program's requests to another server are taken too, and pass untouched:
        # the answer is that server's, not one carried from the primary.
        stream = curl_stream([], fallback.url, lambda n: None, curl=str(program))
        assert not stream.notes
        assert "".join(stream.segments) == direct_text(fallback.url, MAX_TOKENS)
        # Another program's connections are its own: the proxy never sees them.
        connections = proxy.log_path.read_text().count("client connect")
        assert connections > 0  # the program's own, taken
        stream = curl_stream([], primary.url, lambda n: None)
        assert stream.done == 1 and not stream.notes
        assert proxy.log_path.read_text().count("client connect") == connections

        # Killed, the proxy takes its redirector along: the program reaches the server.
        os.kill(proxy.pid, signal.SIGKILL)
        proxy.process.wait()
        deadline = time.monotonic() + 10
        while redirectors() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not redirectors()
        stream = curl_stream([], primary.url, lambda n: None, curl=str(program))
        assert stream.done == 1 and not stream.notes
        proxy.stop()
        control.close()


def redirectors() -> list[str]:
    found = subprocess.run(["pgrep", "-f", "mitmproxy-linux-redirector"], capture_output=True)
    return found.stdout.decode().split()


def doctor_line(prefix: list[str], flag: str) -> str:
    out = subprocess.run(  # (status 1: with no /proc, no memory source can be read)
        [*prefix, sys.executable, "-m", "scripts.doctor", "--proc-root", "/nonexistent"],
        cwd=REPO, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return next(line.strip() for line in out.splitlines() if line.strip()[4:].startswith(flag))


def test_the_doctor_says_what_the_tests_above_found() -> None:
    """Its word on --transparent is what the first test met (it ran: this module is
    skipped otherwise), and without CAP_NET_ADMIN it names the capability."""
    assert doctor_line([], "--transparent") == "ok  --transparent: this machine can"
    without = ["setpriv", "--bounding-set=-net_admin", "--inh-caps=-net_admin"]
    assert "needs CAP_NET_ADMIN" in doctor_line(without, "--transparent")
    capture = doctor_line([], "--capture")
    assert capture.startswith("ok  ") == (local_capture_why_not() is None), capture


def test_rules_that_cannot_be_added_stop_the_proxy_with_the_reason_and_leave_nothing(
    sides, start_server, server_logs
) -> None:
    server_side, _ = sides
    without = ["setpriv", "--bounding-set=-net_admin", "--inh-caps=-net_admin"]
    with server_side.inside():
        primary = start_server("primary", host=SERVER_ADDRESS)
        proxy = SpilloverRun(
            primary.url, [], ["--transparent"], prefix=without, log_dir=server_logs,
            options=SHADOW_OFF,
        )  # fmt: skip
        # Its status route may answer while the rules are being added: then it ends.
        with contextlib.suppress(ServerFailed):
            proxy.start()
        assert proxy.process is not None and proxy.process.wait(timeout=30) != 0
        said = proxy.log_path.read_text()
        assert "no redirect, so not started: " in said and "Operation not permitted" in said
        assert "spillover" not in server_side.nft_ruleset()


HOLDER = """
import subprocess, sys
from addon.surface.nftables import Nftables
nft = Nftables()
nft.run("table inet spillover_test { flags owner\\n}\\n")
quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
child = subprocess.Popen(["sleep", "30"], close_fds=False, **quiet)  # inherits the rest
print(child.pid)
"""


def test_the_rules_go_with_the_proxys_process_even_when_a_child_of_it_lives_on(sides) -> None:
    """The rules' owner is a netlink socket of the proxy's: one a child inherited would
    keep them (and the clients' connections redirected to nothing) past the proxy's end."""
    server_side, _ = sides
    with server_side.inside():
        said = subprocess.run(
            [sys.executable, "-c", HOLDER], cwd=REPO, check=True, capture_output=True, text=True
        )
        try:
            assert "spillover_test" not in server_side.nft_ruleset()
        finally:
            os.kill(int(said.stdout), signal.SIGKILL)


@pytest.mark.skipif(bool(haproxy_missing()), reason=haproxy_missing() or "")
def test_workers_behind_haproxy_take_the_redirected_clients_too(
    sides, start_server, server_logs
) -> None:
    """`--transparent --workers 2`: the rules send the primary's connections to HAProxy,
    and the supervisor holds them: stopped, it removes them; killed, it takes them
    along."""
    server_side, client_side = sides
    from_container = ["ip", "netns", "exec", client_side.name]
    with server_side.inside():
        primary = start_server("primary", host=SERVER_ADDRESS)
        fallback = start_server("fallback")

        def workers() -> SpilloverWorkers:
            return SpilloverWorkers(
                primary.url, [fallback.url], flags=["--transparent"], options=SHADOW_OFF,
                log_dir=server_logs,
            ).start()  # fmt: skip

        pool = workers()
        control = httpx.Client()
        try:
            with Throttled(primary.pid) as throttled:
                handoff = asking_handoff(control, pool, throttled)(ASK_AT)
                stream = curl_stream(from_container, primary.url, handoff)
            assert_one_clean_stream(stream)
            assert len(stream.segments) == 2, stream.notes
            assert_exact_splice(stream, primary.url, fallback.url, MAX_TOKENS)

            pool.stop()  # SIGTERM: the rules go first, then the workers drain
            assert pool.process is not None and pool.process.returncode == 0
            assert "spillover" not in server_side.nft_ruleset()
            stream = curl_stream(from_container, primary.url, lambda n: None)
            assert stream.done == 1 and not stream.notes

            pool = workers()
            assert "spillover" in server_side.nft_ruleset()
            os.kill(pool.pid, signal.SIGKILL)
            pool.process.wait()
            assert "spillover" not in server_side.nft_ruleset()
            stream = curl_stream(from_container, primary.url, lambda n: None)
            assert stream.done == 1 and not stream.notes
        finally:
            pool.stop()
            control.close()
