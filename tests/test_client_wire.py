"""A spliced answer's body on the client's own connection (answer/clientwire.py): once
mitmproxy has passed on what it was given, the splice writes the rest there itself,
framed as mitmproxy frames it, where nothing else reads the body on its way; elsewhere
mitmproxy passes every byte on, as before."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from mitmproxy import io

from addon.servers.framing import ChunkedBody
from scripts.bench.splice import MESSAGES, SseSource
from scripts.parts.processes import running
from scripts.testbed.prompts import PROMPT

PACED = {"stream": True, "messages": MESSAGES, "max_tokens": 40, "interval_ms": 75}


@pytest.fixture
def source(server_logs: Path) -> Iterator[SseSource]:
    """The benchmarks' stand-in: it writes an answer at a pace asked of it."""
    with running(SseSource(log_dir=server_logs)) as (started,):
        yield started


def handed_over(proxy) -> int:
    return proxy.status()["splice_endpoint"]["handed over"]


def test_a_real_answer_goes_on_on_the_clients_connection_framed_as_mitmproxy_frames_it(
    start_server, start_proxy
) -> None:
    primary = start_server("primary")
    proxy = start_proxy(primary.url, [])
    asked = {"model": "m", "messages": PROMPT, "max_tokens": 200, "temperature": 0}
    texts = []
    for url in (primary.url, proxy.url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        chunks = client.chat.completions.create(
            **asked, stream=True, extra_body={"cache_prompt": False}
        )
        texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    assert texts[0] == texts[1] and len(texts[0]) > 200
    assert handed_over(proxy) == 1
    # On the wire: one chunked body, whole, its last chunk once and nothing after it,
    # with as many events as llama-server writes.
    body = json.dumps({**asked, "stream": True, "cache_prompt": False}).encode()
    bodies = [raw_body(port, body) for port in (primary.port, proxy.port)]
    assert bodies[0].count(b"data: ") == bodies[1].count(b"data: ") > 200
    assert bodies[1].endswith(b"data: [DONE]\n\n")
    assert handed_over(proxy) == 2


def raw_body(port: int, body: bytes) -> bytes:
    """The events of a streamed answer read off the socket, its chunked framing checked."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        answer = b""
        while data := sock.recv(65536):
            answer += data
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert b"\r\nTransfer-Encoding: chunked" in head
    assert rest.endswith(b"\r\n0\r\n\r\n") and rest.count(b"\r\n0\r\n\r\n") == 1
    chunked = ChunkedBody()
    events = chunked.feed(rest)
    assert chunked.complete
    return events


def test_an_answer_longer_than_mitmproxys_idle_timeout_goes_on(source, start_proxy) -> None:
    """mitmproxy closes a connection it saw nothing on for `tcp_timeout`; the body it no
    longer carries tells it the connection is in use."""
    proxy = start_proxy(source.url, [], options=["tcp_timeout=1"])
    with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=PACED, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert len(lines) == 40 + 2 and lines[-1] == "data: [DONE]"  # the finish, and [DONE]
    assert handed_over(proxy) == 1


def test_a_body_kept_is_passed_on_by_mitmproxy(source, start_proxy, tmp_path: Path) -> None:
    flows = tmp_path / "flows"
    proxy = start_proxy(source.url, [], options=[f"save_stream_file={flows}"])
    with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=PACED, timeout=30) as r:
        streamed = r.read()
    assert handed_over(proxy) == 0
    proxy.stop()
    with flows.open("rb") as file:  # the client's flow (beside it, the leg's own)
        (kept,) = [f for f in io.FlowReader(file).stream() if "spillover" in f.metadata]
    assert kept.response.content == streamed


def test_a_tls_client_is_passed_on_by_mitmproxy(source, start_proxy) -> None:
    """mitmproxy encrypts what it sends a TLS client: the body stays its to write."""
    proxy = start_proxy(source.url, [])
    url = proxy.url.replace("http://", "https://")
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=PACED, timeout=30, verify=False
    ) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert len(lines) == 40 + 2 and lines[-1] == "data: [DONE]"
    assert handed_over(proxy) == 0


def test_the_owner_may_keep_every_byte_in_mitmproxy(source, start_proxy) -> None:
    proxy = start_proxy(source.url, [], options=["spillover_client_wire=false"])
    with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=PACED, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert len(lines) == 40 + 2 and lines[-1] == "data: [DONE]"
    assert handed_over(proxy) == 0
