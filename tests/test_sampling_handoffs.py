"""The rest of an answer sampled as its first part was, on real servers behind a real
proxy (addon/handoff/sampling.py): a sampler whose running state a new request starts
over, or that a server of an engine not known may not read, ends the answer in-band
with the reason; vLLM's own fields reach a llama-server in its terms, and `min_tokens`
a vLLM counted from the cut (what each leg asked, from the proxy's recorded flows).

The declared fallback is scripts/testbed/openai_upstream.py, standing in for a hosted
API (what no real server here is). The vLLM tests are skipped, saying why, where vLLM's
CPU build cannot run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.mitm import Mitmdump
from scripts.testbed.openai_upstream import OpenAIUpstream
from scripts.testbed.prompts import chat_body
from scripts.testbed.replay import legs_to
from scripts.testbed.vllmserver import SERVED_NAME, VllmServer
from tests.streams import RawStream, assert_one_clean_stream, read_stream
from tests.test_vllm import vllm, vllm_twin  # noqa: F401 (fixtures)

LONG = 120
CUT = 30


def killed_at_cut(proxy: Mitmdump, primary: LlamaServer, body: dict[str, Any]) -> RawStream:
    return read_stream(proxy.url, body, on_chunk=lambda n: n == CUT and primary.kill())


def test_a_sampler_whose_state_starts_over_is_not_carried(
    start_server: Callable[..., LlamaServer], start_proxy: Callable[..., Mitmdump]
) -> None:
    """Mirostat steers by a running target each request starts afresh: on another
    llama-server the rest would not be sampled as the answer was."""
    primary, fallback = start_server("primary"), start_server("fallback")
    proxy = start_proxy(primary.url, [fallback.url])
    proxy.servers_known()
    stream = killed_at_cut(proxy, primary, chat_body(LONG, mirostat=2, temperature=0.8, seed=1))
    assert stream.segments[0] and stream.done == 0
    (error,) = stream.errors
    assert "mirostat would start over on llama-server" in error["error"]["message"]


def test_a_field_a_declared_server_may_not_read_ends_the_answer(
    start_server: Callable[..., LlamaServer], start_proxy: Callable[..., Mitmdump]
) -> None:
    """A hosted API declared to continue: whether it reads llama.cpp's top_k is not
    known, so the answer does not go on there without it; OpenAI's own fields go."""
    hosted = OpenAIUpstream("hosted", mode="continue")
    declared = [f"spillover_continue_by={hosted.url}=message"]
    for fields, carried in (({"top_k": 20}, False), ({"top_p": 0.9}, True)):
        primary = start_server("primary")
        proxy = start_proxy(primary.url, [hosted.url], options=declared)
        proxy.servers_known()
        stream = killed_at_cut(proxy, primary, chat_body(LONG, **fields))
        if carried:
            assert_one_clean_stream(stream)
            continue
        (error,) = stream.errors
        assert "whether it reads top_k (top-k) is not known" in error["error"]["message"]
        assert hosted.url in error["error"]["message"] and stream.done == 0
    hosted.close()


def handed_off(proxy: Mitmdump, body: dict[str, Any]) -> RawStream:
    url = proxy.url
    stream = read_stream(
        url, body, on_chunk=lambda n: n == CUT and httpx.post(f"{url}/spillover/handoff")
    )
    assert_one_clean_stream(stream)
    return stream


def test_vllms_repetition_penalty_is_asked_of_llama_server_in_its_terms(
    start_server: Callable[..., LlamaServer],
    start_proxy: Callable[..., Mitmdump],
    vllm: VllmServer,  # noqa: F811
    tmp_path: Path,
) -> None:
    """vLLM weighs every token of the prompt and answer: llama-server's repeat_penalty
    with its window the whole context. `min_tokens`, held already, is not sent."""
    fallback = start_server("fallback")
    flows = tmp_path / "flows.mitm"
    proxy = start_proxy(vllm.url, [fallback.url], options=[f"save_stream_file={flows}"])
    context = proxy.servers_known()[fallback.url]["slot_context"]
    body = chat_body(LONG, model=SERVED_NAME, repetition_penalty=1.3, min_tokens=5)
    stream = handed_off(proxy, body)
    assert f"{vllm.url} -> {fallback.url}" in stream.notes[0]
    proxy.stop()  # the recording is whole
    (sent,) = legs_to(flows, fallback.port)
    assert sent["repeat_penalty"] == 1.3 and sent["repeat_last_n"] == context
    assert "repetition_penalty" not in sent and "min_tokens" not in sent


def test_min_tokens_is_counted_from_the_cut_between_vllms(
    start_proxy: Callable[..., Mitmdump],
    vllm: VllmServer,  # noqa: F811
    vllm_twin,  # noqa: F811
    tmp_path: Path,
) -> None:
    flows = tmp_path / "flows.mitm"
    proxy = start_proxy(vllm.url, [vllm_twin.url], options=[f"save_stream_file={flows}"])
    proxy.servers_known()
    stream = handed_off(proxy, chat_body(LONG, model=SERVED_NAME, min_tokens=LONG - 10))
    (handoff,) = httpx.get(f"{proxy.url}/spillover/status").json()["recent_handoffs"]
    assert "replayed as token ids" in stream.notes[0]
    proxy.stop()
    (sent,) = legs_to(flows, int(vllm_twin.url.rsplit(":", 1)[1]))
    assert sent["min_tokens"] == LONG - 10 - handoff["at_token"]
