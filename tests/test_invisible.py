"""With no handoff, a client cannot tell the proxy is there.

Two identical llama-servers (same model, same arguments, both fresh) get the same corpus
of requests in the same order: one directly, one through mitmdump with the addon (and a
fallback that never has to step in). Every answer is compared field by field: status,
reason phrase, headers (names as written, values), and the body: JSON parsed, streams
event by event. Only what differs between two direct runs is left out: ids, `created`
stamps and `timings`, and the time-based series of /metrics.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
import pytest

from scripts.testbed.prompts import PROMPT

VOLATILE = {"id", "item_id", "created", "created_at", "timings", "t_start", "media_marker"}
ASKED = ("n_probs", "post_sampling_probs", "timings_per_token")
# A body's length moves with its timings; a process's start time with the process.
VOLATILE_HEADERS = {b"content-length", b"process-start-time-unix"}
TEXT = "The river ran under the old stone bridge"
IMAGE = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
CHAT = {"messages": PROMPT, "max_tokens": 24, "temperature": 0}


def chat(**extra: Any) -> dict[str, Any]:
    return {**CHAT, **extra}


def text(**extra: Any) -> dict[str, Any]:
    return {"prompt": TEXT, "max_tokens": 16, "temperature": 0, **extra}


def messages(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": PROMPT, "max_tokens": 24, "temperature": 0, **extra}


def responses(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "input": TEXT, "max_output_tokens": 24, "temperature": 0, **extra}


def native(**extra: Any) -> dict[str, Any]:
    return {"prompt": TEXT, "n_predict": 16, "temperature": 0, **extra}


# (method, path, body): every route a client of llama-server uses, streaming and not, with
# the parameters that shape what comes back, and requests the server refuses.
CORPUS: list[tuple[str, str, Any]] = [
    ("GET", "/health", None),
    ("GET", "/v1/models", None),
    ("GET", "/props", None),
    ("GET", "/slots", None),
    ("POST", "/tokenize", {"content": TEXT, "with_pieces": True}),
    ("POST", "/detokenize", {"tokens": [1, 2, 3]}),
    ("POST", "/apply-template", {"messages": PROMPT}),
    ("POST", "/v1/chat/completions", chat()),
    ("POST", "/v1/chat/completions", chat(stream=True)),
    ("POST", "/v1/chat/completions", chat(stream=True, stream_options={"include_usage": True})),
    ("POST", "/v1/chat/completions", chat(stream=True, logprobs=True, top_logprobs=2)),
    ("POST", "/v1/chat/completions", chat(stream=True, n_probs=2)),
    ("POST", "/v1/chat/completions", chat(stream=True, logprobs=True, post_sampling_probs=True)),
    ("POST", "/v1/chat/completions", chat(logprobs=True, top_logprobs=3)),
    # Probability fields the server decides about: never rewritten into ones it takes.
    ("POST", "/v1/chat/completions", chat(stream=True, logprobs="yes")),
    ("POST", "/v1/chat/completions", chat(stream=True, logprobs=False, top_logprobs=2)),
    ("POST", "/v1/chat/completions", chat(stream=True, n_probs="2")),
    ("POST", "/v1/chat/completions", chat(stream=True, logprobs=False)),
    ("POST", "/v1/chat/completions", chat(stream=True, timings_per_token=True)),
    ("POST", "/v1/chat/completions", chat(stream=True, return_tokens=True)),
    ("POST", "/v1/chat/completions", chat(stream=True, cache_prompt=False)),
    ("POST", "/v1/chat/completions", chat(stream=True, id_slot=1)),
    ("POST", "/v1/chat/completions", chat(stream=True, temperature=0.8, seed=42)),
    ("POST", "/v1/chat/completions", chat(stream=True, max_completion_tokens=5)),
    ("POST", "/v1/chat/completions", chat(stream=True, stop=[" the"])),
    (
        "POST",
        "/v1/chat/completions",
        chat(messages=[*PROMPT, {"role": "assistant", "content": "Once"}], stream=True),
    ),
    ("POST", "/v1/chat/completions", chat(stream=True, n=2)),
    (
        "POST",
        "/v1/chat/completions",
        chat(
            stream=True,
            tools=[
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
            ],
        ),
    ),
    ("POST", "/v1/chat/completions", chat(stream=True, max_tokens="ten")),
    # Refused by every server (5xx, so the fallback is asked too): the primary's own error.
    ("POST", "/v1/chat/completions", chat(messages=IMAGE)),
    ("POST", "/v1/chat/completions", chat(messages=IMAGE, stream=True)),
    ("POST", "/v1/chat/completions", chat(messages="not a list")),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user"'),
    ("POST", "/v1/completions", text()),
    ("POST", "/v1/completions", text(stream=True)),
    ("POST", "/v1/completions", text(stream=True, logprobs=2)),
    ("POST", "/v1/completions", text(logprobs=2)),
    ("POST", "/v1/completions", text(stream=True, stream_options={"include_usage": True})),
    ("POST", "/completion", native()),
    ("POST", "/completion", native(stream=True)),
    ("POST", "/completion", native(stream=True, n_probs=2, post_sampling_probs=True)),
    ("POST", "/completion", native(stream=True, return_tokens=True, timings_per_token=True)),
    ("POST", "/completion", native(stream=True, prompt=[1, 2, 3, 4])),
    # The other APIs llama-server serves (and the addon carries).
    ("POST", "/v1/messages", messages()),
    ("POST", "/v1/messages", messages(stream=True)),
    ("POST", "/v1/messages", messages(stream=True, thinking={"type": "enabled"})),
    ("POST", "/v1/responses", responses()),
    ("POST", "/v1/responses", responses(stream=True)),
    ("POST", "/infill", {"input_prefix": "def f(", "input_suffix": ")"}),
    ("POST", "/v1/embeddings", {"input": TEXT}),
    ("GET", "/slots", None),
    ("GET", "/metrics", None),
]


def send(client: httpx.Client, base: str, method: str, path: str, body: Any) -> dict:
    """What a client sees: the status line, the headers as written, and the body."""
    content = body if isinstance(body, bytes) else None if body is None else json.dumps(body)
    headers = {"content-type": "application/json"} if body is not None else {}
    with client.stream(method, base + path, content=content, headers=headers) as reply:
        raw = b"".join(reply.iter_raw())
    return {
        "status": reply.status_code,
        "reason": reply.reason_phrase,
        "headers": [  # in the order written
            (k.decode(), "" if k.lower() in VOLATILE_HEADERS else v.decode())
            for k, v in reply.headers.raw
        ],
        "body": comparable(raw, reply.headers.get("content-type", ""), path),
    }


def comparable(raw: bytes, kind: str, path: str) -> Any:
    if path == "/metrics":  # time-based series differ between any two runs
        return [
            line
            for line in raw.decode().splitlines()
            if "seconds" not in line and "per_second" not in line and "per_decode" not in line
        ]
    if kind.startswith("text/event-stream"):
        return [without_volatile(event) for event in raw.decode().split("\n\n") if event]
    if path == "/slots" and isinstance(slots := json.loads(raw), list):
        # A slot's record of its last task shows what the addon asked of it with a chat
        # stream where another server could continue (each token's piece and the count,
        # taken out again before the client sees them).
        for slot in slots:
            for name in ASKED:
                slot.get("params", {}).pop(name, None)
        return without_volatile(slots)
    try:
        return without_volatile(json.loads(raw))
    except ValueError:
        return raw.decode(errors="replace")


def without_volatile(value: Any) -> Any:
    if isinstance(value, str) and value.startswith("event: ") and "\ndata: {" in value:
        name, data = value.split("\n", 1)  # an event that names its type first
        return name + "\n" + without_volatile(data)
    if isinstance(value, str) and value.startswith("data: {"):
        return "data: " + json.dumps(without_volatile(json.loads(value[6:])), sort_keys=True)
    if isinstance(value, dict):
        return {k: without_volatile(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [without_volatile(v) for v in value]
    return value


@pytest.fixture(scope="module")
def twins(start_server_module, start_proxy_module):
    direct = start_server_module("primary")
    behind = start_server_module("primary")
    fallback = start_server_module("fallback")
    proxy = start_proxy_module(behind.url, [fallback.url])
    proxy.servers_known()
    return direct, behind, proxy


def test_without_a_handoff_the_proxy_is_invisible(twins) -> None:
    direct, _, proxy = twins
    differences = []
    with httpx.Client(timeout=60) as client:
        for method, path, body in CORPUS:
            mine = send(client, direct.url, method, path, body)
            theirs = send(client, proxy.url, method, path, body)
            if mine != theirs:
                differences.append((method, path, body, first_difference(mine, theirs)))
    assert not differences, "\n".join(map(str, differences))


def test_streams_on_routes_the_addon_does_not_carry_arrive_as_they_come(twins) -> None:
    """llama-server's native /completion stream: its first event reaches the client while
    the server is still writing the answer (mitmproxy would otherwise hold the whole body
    back until the end)."""
    _, behind, proxy = twins
    body = native(stream=True, n_predict=1000)
    with httpx.stream("POST", f"{proxy.url}/completion", json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        slots = httpx.get(f"{behind.url}/slots").json()
        assert any(slot["is_processing"] for slot in slots), "the answer came whole, at its end"
        for _ in lines:
            pass


@pytest.mark.parametrize(
    ("version", "extra"),
    [("HTTP/1.1", b""), ("HTTP/1.1", b"Connection: close\r\n"), ("HTTP/1.0", b"")],
)
def test_a_stream_is_framed_as_the_server_frames_it(twins, version: str, extra: bytes) -> None:
    """The response head, line by line, for a keep-alive client, one that says
    `Connection: close`, and an HTTP/1.0 one (llama-server streams chunked to it too)."""
    direct, _, proxy = twins
    body = json.dumps(chat(stream=True)).encode()
    request = (
        (
            f"POST /v1/chat/completions {version}\r\nHost: x\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        ).encode()
        + extra
        + b"\r\n"
        + body
    )
    heads = []
    for server in (direct, proxy):
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(request)
            answer = b""
            while not answer.endswith(b"\r\n0\r\n\r\n") and (data := sock.recv(65536)):
                answer += data
        head, _, rest = answer.partition(b"\r\n\r\n")
        assert rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), rest[-40:]
        heads.append(head.split(b"\r\n"))
    assert heads[0] == heads[1]


def test_answers_on_one_kept_connection_each_end_their_endpoint_connection(twins) -> None:
    """Two streamed answers in turn on one client connection: each arrives chunked and
    whole, the client's connection carries the next, and the endpoint's connections
    (a streamed body there runs to its connection's close) are all closed while the
    client's stays open: none is left half open behind it."""
    _, _, proxy = twins
    body = json.dumps(chat(stream=True)).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    endpoint = proxy.status()["splice_endpoint"]
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as sock:
        for _ in range(2):
            sock.sendall(request)
            answer = b""
            while not answer.endswith(b"\r\n0\r\n\r\n"):
                data = sock.recv(65536)
                assert data, answer[-200:]  # the connection stays open after an answer
                answer += data
            head, _, rest = answer.partition(b"\r\n\r\n")
            assert b"\r\nTransfer-Encoding: chunked" in head and b"Spillover" not in head
            assert rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        after = proxy.status()["splice_endpoint"]
        assert after["in process"] == endpoint["in process"] + 2, (endpoint, after)
        deadline = time.monotonic() + 10
        while (after := proxy.status()["splice_endpoint"])["open"]:
            assert time.monotonic() < deadline, after
            time.sleep(0.05)


def first_difference(a: Any, b: Any, where: str = "") -> str:
    """Where two answers first part, and how."""
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        key = next(k for k in a if a[k] != b[k])
        return first_difference(a[key], b[key], f"{where}.{key}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        index = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        return first_difference(a[index], b[index], f"{where}[{index}]")
    return f"{where}: direct {a!r:.300} / proxy {b!r:.300}"
