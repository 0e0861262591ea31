"""A fallback on another machine behind TLS whose certificate a private CA signed, as on
an operator's own network: HAProxy (a real component) terminates TLS in front of a real
llama-server. The addon's connections to it (the legs, /health, its questions) verify
it as mitmproxy verifies its own upstreams: with the CA `ssl_verify_upstream_trusted_ca`
names, not at all with `ssl_insecure`, and otherwise not trusted, which routing says."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.parts.processes import free_port
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.mitm import Mitmdump
from scripts.testbed.relay import Relay
from scripts.testbed.tlscerts import private_ca_and_server
from tests.streams import assert_exact_splice, assert_one_clean_stream, chat_body, read_stream
from tests.test_routing import routing_of, state_of
from tests.test_splice import handoff_after

LONG = 300


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return private_ca_and_server(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def behind_tls(
    fallback: LlamaServer, certificates: tuple[Path, Path], server_logs: Path
) -> Iterator[str]:
    relay = Relay(fallback.url, log_dir=server_logs, every_route=True, tls=certificates)
    relay.start()
    yield relay.url
    relay.stop()


def test_a_fallback_behind_tls_signed_by_the_named_ca_takes_a_handoff(
    start_proxy, primary: LlamaServer, fallback: LlamaServer, behind_tls: str, certificates
) -> None:
    assert behind_tls.startswith("https://")
    ca = certificates[0]
    proxy = start_proxy(primary.url, [behind_tls], [f"ssl_verify_upstream_trusted_ca={ca}"])
    assert proxy.servers_known()[behind_tls]["continues"]  # its questions, over TLS
    assert state_of(proxy, behind_tls) == "ok"  # its /health, over TLS
    stream = read_stream(proxy.url, chat_body(LONG), on_chunk=handoff_after(proxy, 20, primary))
    assert_one_clean_stream(stream)
    assert len(stream.notes) == 1 and behind_tls in stream.notes[0], stream.notes
    assert_exact_splice(stream, primary.url, fallback.url, LONG)  # the same server, directly


def test_a_fallback_whose_ca_is_not_named_is_not_trusted_and_routing_says_why(
    start_proxy, primary: LlamaServer, behind_tls: str
) -> None:
    proxy = start_proxy(primary.url, [behind_tls])
    deadline = time.monotonic() + 30
    while state_of(proxy, behind_tls) != "down":
        assert time.monotonic() < deadline, routing_of(proxy, behind_tls)
        time.sleep(0.1)
    why = routing_of(proxy, behind_tls)["why"]
    assert why.startswith("/health: cannot connect (TLS: ") and "certificate" in why, why


def test_with_ssl_insecure_a_fallback_behind_tls_is_not_verified(
    start_proxy, primary: LlamaServer, behind_tls: str
) -> None:
    proxy = start_proxy(primary.url, [behind_tls], ["ssl_insecure=true"])
    assert proxy.servers_known()[behind_tls]["continues"]
    assert state_of(proxy, behind_tls) == "ok"


def test_trusted_cas_that_cannot_be_read_are_refused_at_start(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-ca.pem"
    options = [f"ssl_verify_upstream_trusted_ca={missing}"]
    proxy = Mitmdump(f"http://127.0.0.1:{free_port()}", options=options)
    run = subprocess.run(proxy.argv(), capture_output=True, text=True, timeout=60)
    said = run.stdout + run.stderr
    assert run.returncode != 0, said
    assert f"spillover: cannot read the trusted CAs in {missing}: " in said, said
    assert "spillover: not started; fix the options above" in said
