"""Clients that change nothing: `spillover run --transparent` has the kernel send the
primary's connections to the proxy (mitmproxy's transparent mode, nftables rules held by
the proxy's process), and nothing is left when the proxy goes.

Everything runs in two network namespaces the test makes (a server side, where the
servers, the proxy and its rules live, and a client side joined to it by a veth link,
as a container is to its host): the machine's own traffic and rules are never touched.
The clients are unmodified curl processes that name the server's own address and port:
one from the other namespace (its connections pass the server side's prerouting), one
on the server side as another user (its connections pass the output hook; the proxy's
own user is exempt there, so the proxy still reaches the server).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator

import httpx
import pytest

from addon.surface.nftables import owner_tables_work
from scripts.testbed import netns
from scripts.testbed.mitm import SpilloverRun
from scripts.testbed.netns import SERVER_ADDRESS, Netns
from scripts.testbed.prompts import chat_body
from tests.conftest import SHADOW_OFF
from tests.streams import RawStream, assert_exact_splice, assert_one_clean_stream, record
from tests.test_splice import held

MAX_TOKENS = 120
NOBODY = "65534"


def _why_skip() -> str | None:
    if why := netns.why_not():
        return why
    return owner_tables_work()


pytestmark = pytest.mark.skipif(bool(_why_skip()), reason=_why_skip() or "")


@pytest.fixture
def sides() -> Iterator[tuple[Netns, Netns]]:
    server, client = Netns.pair()
    yield server, client
    server.delete()
    client.delete()


def curl_stream(command: list[str], url: str, on_chunk) -> RawStream:
    """Stream a chat completion with curl (started by `command`: a namespace, a user)."""
    body = json.dumps(chat_body(MAX_TOKENS))
    curl = subprocess.Popen(
        [*command, "curl", "-sSN", "--max-time", "60", "-H", "content-type: application/json",
         "-d", body, f"{url}/v1/chat/completions"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    stream = RawStream()
    assert curl.stdout is not None
    for line in curl.stdout:
        record(stream, line.rstrip("\n"))
        if line.startswith("data: {"):
            on_chunk(len(stream.chunks))
    assert curl.wait() == 0, curl.stderr.read() if curl.stderr else ""
    stream.status = 200
    return stream


def test_clients_that_keep_the_servers_url_get_a_handed_off_answer_until_the_proxy_goes(
    sides, start_server, server_logs
) -> None:
    server_side, client_side = sides
    from_container = ["ip", "netns", "exec", client_side.name]
    as_other_user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    with server_side.inside():
        primary = start_server("primary", host=SERVER_ADDRESS)
        fallback = start_server("fallback")
        server_url = primary.url  # what every client names, before and after
        proxy = SpilloverRun(
            primary.url, [fallback.url], ["--transparent"], log_dir=server_logs,
            options=SHADOW_OFF,
        ).start()  # fmt: skip
        control = httpx.Client()

        def handoff_at(chunks: int):
            def on_chunk(n: int) -> None:
                if n == chunks:
                    with held(primary):
                        reply = control.post(f"{proxy.url}/spillover/handoff", json={})
                        assert reply.json()["handed_off"] == 1, reply.text

            return on_chunk

        assert f"tcp dport {primary.port} redirect to :" in server_side.nft_ruleset()
        for client in (from_container, as_other_user):
            stream = curl_stream(client, server_url, handoff_at(30))
            assert_one_clean_stream(stream)
            assert len(stream.segments) == 2, (client, stream.notes)
            assert_exact_splice(stream, primary.url, fallback.url, MAX_TOKENS)

        # Stopped, the proxy leaves no rule: the same clients reach the server itself.
        proxy.stop()
        assert "spillover" not in server_side.nft_ruleset()
        for client in (from_container, as_other_user):
            stream = curl_stream(client, server_url, lambda n: None)
            assert not stream.notes and stream.done == 1, stream.notes

        # Killed, likewise: the kernel drops the rules with the proxy's process.
        proxy = SpilloverRun(
            primary.url, [fallback.url], ["--transparent"], log_dir=server_logs,
            options=SHADOW_OFF,
        ).start()  # fmt: skip
        assert "spillover" in server_side.nft_ruleset()
        os.kill(proxy.pid, signal.SIGKILL)
        proxy.process.wait()
        assert "spillover" not in server_side.nft_ruleset()
        for client in (from_container, as_other_user):
            stream = curl_stream(client, server_url, lambda n: None)
            assert stream.done == 1 and len(stream.segments) == 1
        proxy.stop()
        control.close()
