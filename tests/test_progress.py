"""What a server's `/metrics` says of its progress (servers/progress.py), read off a real
llama-server (run with --metrics) before and after an answer. vLLM's is read in
tests/test_vllm_queue.py, where the proxy waits on it."""

from __future__ import annotations

import httpx

from addon.servers.progress import Progress, progress_of
from scripts.testbed.llamaserver import LlamaServer
from tests.streams import chat_body


def progress(server: LlamaServer) -> Progress:
    read = progress_of(httpx.get(f"{server.url}/metrics").raise_for_status().text)
    assert read is not None, "llama-server's /metrics counts no tokens"
    return read


def test_a_llama_servers_token_counts_move_with_its_answers(primary: LlamaServer) -> None:
    before = progress(primary)
    body = {**chat_body(24), "stream": False}
    answer = httpx.post(f"{primary.url}/v1/chat/completions", json=body, timeout=60).json()
    after = progress(primary)
    usage = answer["usage"]
    assert after.tokens - before.tokens >= usage["completion_tokens"]
    said = after.since(before, 1.0)
    assert said is not None and "tokens read and written in 1 s" in said
    assert after.since(after, 1.0) is None  # standing still: no progress
    assert (after.running, after.waiting) == (0, 0)


def test_what_counts_no_tokens_is_none() -> None:
    assert progress_of('{"detail": "Not Found"}') is None
    assert progress_of("# TYPE other_total counter\nother_total 5\n") is None
