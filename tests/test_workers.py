"""`spillover run --workers 2`: HAProxy (Debian's) in front of two whole proxies, in front
of real llama-servers. An answer through them is the server's own; a handoff or a
drain asked of any worker reaches the one that carries the answer; metrics are summed;
a worker killed mid-answer cuts only its own answers, and is started again; with every
worker gone, clients reach the primary through HAProxy's backup."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from addon.surface.siblings import summed
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.workers import SpilloverWorkers, haproxy_missing
from tests.streams import (
    RawStream,
    assert_exact_splice,
    assert_one_clean_stream,
    chat_body,
    direct_text,
    read_stream,
)

pytestmark = pytest.mark.skipif(
    haproxy_missing() is not None, reason=f"{haproxy_missing()} (scripts/test.sh does as root)"
)
LONG = 600


@pytest.fixture
def pool(
    primary: LlamaServer, fallback: LlamaServer, server_logs: Path
) -> Iterator[SpilloverWorkers]:
    workers = SpilloverWorkers(
        primary.url, [fallback.url], options=["spillover_shadow=off"], log_dir=server_logs
    ).start()
    workers.servers_known()
    yield workers
    workers.stop()


def handed_off(url: str) -> float:
    metrics = httpx.get(f"{url}/spillover/metrics").text
    found = re.search(r'spillover_handoffs_total\{kind="requested"\} (\S+)', metrics)
    return float(found.group(1)) if found else 0.0


def test_a_handoff_asked_of_any_worker_reaches_the_answer(
    pool: SpilloverWorkers, primary: LlamaServer, fallback: LlamaServer
) -> None:
    """The answer holds one worker; HAProxy (leastconn) sends the control request to the
    other, which passes it on. Either worker's metrics count the one handoff."""
    assert read_stream(pool.url, chat_body(40)).text == direct_text(primary.url, 40)
    stream = read_stream(
        pool.url, chat_body(LONG),
        on_chunk=lambda n: n == 30 and httpx.post(f"{pool.url}/spillover/handoff"),
    )  # fmt: skip
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert f"{primary.url} -> {fallback.url}" in note
    status = httpx.get(f"{pool.url}/spillover/status").json()
    (cut,) = [h for s in [status, *status["other_workers"]] for h in s["recent_handoffs"]]
    assert cut["kind"] == "requested"
    assert_exact_splice(stream, primary.url, fallback.url, LONG)
    for port in pool.worker_ports():  # each worker answers for both
        assert handed_off(f"http://127.0.0.1:{port}") == 1.0


def test_a_drain_asked_of_one_worker_reaches_every_worker(
    pool: SpilloverWorkers, fallback: LlamaServer
) -> None:
    reply = httpx.post(f"{pool.url}/spillover/drain", json={"server": fallback.url})
    assert reply.status_code == 200
    for port in pool.worker_ports():
        states = httpx.get(f"http://127.0.0.1:{port}/spillover/status").json()["routing"]["states"]
        assert states[fallback.url]["state"] == "draining"
    httpx.post(f"{pool.url}/spillover/undrain", json={"server": fallback.url})
    for port in pool.worker_ports():
        states = httpx.get(f"http://127.0.0.1:{port}/spillover/status").json()["routing"]["states"]
        assert states[fallback.url]["state"] != "draining"


def test_a_killed_worker_cuts_only_its_own_answers(
    pool: SpilloverWorkers, primary: LlamaServer
) -> None:
    """Two answers, one on each worker (leastconn). SIGKILL the worker of the first: its
    client sees the connection end mid-answer, as with a dead proxy; the other answer
    ends whole; a new request is answered at once, and the worker is started again."""
    streams: dict[str, RawStream | BaseException] = {}
    second_started = threading.Event()

    def read(name: str, on_chunk=None) -> None:
        try:
            streams[name] = read_stream(pool.url, chat_body(LONG), on_chunk=on_chunk)
        except httpx.HTTPError as exc:
            streams[name] = exc

    first = threading.Thread(target=read, args=("first",))
    first.start()
    deadline = time.monotonic() + 30
    while not (busy := live_ports(pool)) and time.monotonic() < deadline:
        time.sleep(0.05)
    second = threading.Thread(
        target=read, args=("second", lambda n: n == 5 and second_started.set())
    )
    second.start()
    assert second_started.wait(30)
    (victim,) = busy
    os.kill(pool.workers()[victim], signal.SIGKILL)
    first.join(60)
    second.join(60)
    assert isinstance(streams["first"], httpx.HTTPError) or streams["first"].done == 0
    whole = streams["second"]
    assert isinstance(whole, RawStream)
    assert_one_clean_stream(whole)
    assert whole.text == direct_text(primary.url, LONG)
    assert read_stream(pool.url, chat_body(40)).text == direct_text(primary.url, 40)
    deadline = time.monotonic() + 30
    while victim not in pool.worker_ports() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert victim in pool.worker_ports()  # started again, on its port


def live_ports(pool: SpilloverWorkers) -> list[int]:
    """The workers carrying an answer now."""
    return [
        port
        for port in pool.worker_ports()
        if httpx.get(f"http://127.0.0.1:{port}/spillover/status").json()["live"]
    ]


def test_with_every_worker_gone_clients_reach_the_primary(
    pool: SpilloverWorkers, primary: LlamaServer
) -> None:
    """The supervisor is held (SIGSTOP) so that it starts no worker again; once HAProxy's
    checks find both workers down, requests go to the primary itself: its own 404 for
    the control route, its own answer for a question."""
    os.kill(pool.pid, signal.SIGSTOP)
    try:
        for pid in pool.workers().values():
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{pool.url}/spillover/health").status_code == 404:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        assert httpx.get(f"{pool.url}/spillover/health").status_code == 404  # llama-server's
        body = {**chat_body(40), "stream": False}
        reply = httpx.post(f"{pool.url}/v1/chat/completions", json=body, timeout=60)
        assert reply.json()["choices"][0]["message"]["content"] == direct_text(primary.url, 40)
    finally:
        os.kill(pool.pid, signal.SIGCONT)


def test_without_haproxy_workers_say_what_to_install(primary: LlamaServer) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "scripts.cli", "run", "--primary", primary.url, "--workers", "2"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "SPILLOVER_HAPROXY": "/nonexistent/haproxy"},
    )  # fmt: skip
    assert run.returncode == 2
    assert "/nonexistent/haproxy not found): apt-get install haproxy" in run.stderr


def test_stopping_lets_the_live_answers_end_whole(
    primary: LlamaServer, fallback: LlamaServer, server_logs: Path
) -> None:
    """SIGTERM to `spillover run --workers`: HAProxy drains every worker, so an answer
    streaming then ends whole before the workers stop."""
    workers = SpilloverWorkers(primary.url, [fallback.url], log_dir=server_logs).start()
    children = workers.pids()
    assert len(children) == 3  # two workers and HAProxy
    try:
        stream = read_stream(
            workers.url, chat_body(LONG),
            on_chunk=lambda n: n == 10 and os.kill(workers.pid, signal.SIGTERM),
        )  # fmt: skip
        assert_one_clean_stream(stream)
        assert stream.text == direct_text(primary.url, LONG)
        assert workers.process is not None and workers.process.wait(30) == 0
        assert not any(Path(f"/proc/{pid}").exists() for pid in children)  # all gone
    finally:
        workers.stop()


def test_a_servers_slow_health_is_one_workers_word_not_a_sum() -> None:
    """Each worker judges a server's /health itself, as it does the server's state: the
    metrics every worker answers for all of them say it once, not once per worker."""
    slow = 'spillover_server_health_slow{server="http://127.0.0.1:8081",why="while it streams"}'
    head = "# HELP spillover_server_health_slow h\n# TYPE spillover_server_health_slow gauge\n"
    each = f"{head}{slow} 1.0\n"
    assert f"{slow} 1.0" in summed(each.encode(), [each]).decode()
