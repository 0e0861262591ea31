"""A busy vLLM's queue is waited out, a wedged vLLM is left: a real vLLM (its CPU build)
that runs one request at a time (`--max-num-seqs 1`), so that an answer asked while two
long ones run waits in its queue for seconds, past the first-token wait of a server the
proxy never measured (set to 1 s here). vLLM keeps no `/slots`; its `/metrics` counts
the tokens it reads and writes, and those move while it works through its queue. With
its engine stopped (SIGSTOP on the EngineCore: its API server still answers) they do
not, and the answer goes to the fallback as before."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from addon.servers.progress import progress_of
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.vllmserver import (
    SERVED_NAME,
    VllmServer,
    hf_copy,
)
from tests.streams import assert_one_clean_stream, read_stream
from tests.vllmhere import vllm_or_skip
from watchers.listeners import descendants

pytestmark = pytest.mark.timeout(300)
WAIT = ["spillover_first_token_unmeasured_s=1"]
ASKED = {
    "model": SERVED_NAME, "stream": True, "max_tokens": 12, "temperature": 0,
    "messages": [{"role": "user", "content": "Tell me about rivers."}],
}  # fmt: skip


@pytest.fixture(scope="module")
def one_at_a_time(models: dict[str, Path], server_logs: Path) -> Iterator[VllmServer]:
    vllm_or_skip()
    server = VllmServer(
        hf_copy(models["fallback"]), max_model_len=1024, log_dir=server_logs,
        extra_args=["--max-num-seqs", "1"],
    ).start(timeout=300)  # fmt: skip
    yield server
    server.stop()


def running_long(url: str, answers: int) -> list[threading.Thread]:
    """`answers` long answers asked of vLLM directly (the others of a busy server), each
    running to its context's end (about two seconds here)."""
    body = {**ASKED, "max_tokens": 900, "ignore_eos": True, "stream": False}

    def ask() -> None:
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)

    threads = [threading.Thread(target=ask) for _ in range(answers)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30  # both in vLLM before the answer asked after them
    while (counts := progress_of(httpx.get(f"{url}/metrics").text)) is None or (
        counts.running + counts.waiting < answers
    ):
        assert time.monotonic() < deadline, f"vLLM never had them: {counts}"
        time.sleep(0.05)
    return threads


def own_answer(url: str) -> str:
    asked = {**ASKED, "stream": False}
    reply = httpx.post(f"{url}/v1/chat/completions", json=asked, timeout=120).json()
    return reply["choices"][0]["message"]["content"]


def test_an_answer_queued_behind_a_busy_vllm_waits_its_turn(
    one_at_a_time: VllmServer, fallback: LlamaServer, start_proxy
) -> None:
    proxy = start_proxy(one_at_a_time.url, [fallback.url], options=WAIT)
    proxy.servers_known()
    others = running_long(one_at_a_time.url, 2)
    try:
        stream = read_stream(proxy.url, ASKED, timeout=120)
    finally:
        for thread in others:
            thread.join()
    assert_one_clean_stream(stream)
    assert stream.notes == [], "the answer left the busy vLLM"
    assert stream.text == own_answer(one_at_a_time.url)
    said = proxy.log_tail(200)
    assert f"{one_at_a_time.url} is still at work (" in said
    assert "tokens read and written in" in said


def test_a_vllm_whose_engine_is_stopped_is_left(
    one_at_a_time: VllmServer, fallback: LlamaServer, start_proxy
) -> None:
    proxy = start_proxy(one_at_a_time.url, [fallback.url], options=WAIT)
    proxy.servers_known()
    engine = descendants(one_at_a_time.pid)
    assert engine, "vLLM runs its engine in a process of its own"
    for pid in engine:
        os.kill(pid, signal.SIGSTOP)
    try:
        stream = read_stream(proxy.url, ASKED, timeout=120)
    finally:
        for pid in engine:
            os.kill(pid, signal.SIGCONT)
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert f"{one_at_a_time.url} -> {fallback.url}" in note
    assert "is still at work" not in proxy.log_tail(200)
