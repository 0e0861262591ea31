"""What a continuation leg adds to the client's chunks: nothing the client did not ask
for, and no special token the model did not write. Real llama-servers with Qwen3's
template (whose trailing message opens a reasoning block the model never wrote, so the
answer goes on as a text completion on the native /completion) behind a real proxy; a
real router and a real llama-cpp-python asked the same."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from scripts.testbed.llamacppfiles import templates
from scripts.testbed.llamacpppython import LlamaCppPythonServer
from scripts.testbed.llamaserver import LlamaRouter, LlamaServer
from scripts.testbed.mitm import Mitmdump
from scripts.testbed.openai_upstream import HALF_PAIR_AT, OpenAIUpstream
from scripts.testbed.scripted_upstream import STREAM_HEAD, FakeUpstream, chunked, sse_chunk
from scripts.testbed.tinymodels import reasoning_template
from tests.chat_shapes import SHAPES
from tests.streams import RawStream, assert_one_clean_stream, read_stream

QWEN3 = "Qwen-Qwen3-0.6B"
NEMO = "mistralai-Mistral-Nemo-Instruct-2407"


def templated_pair(
    start_server: Callable[..., LlamaServer],
    start_proxy: Callable[..., Mitmdump],
    template: str,
    *args: str,
) -> tuple[LlamaServer, LlamaServer, Mitmdump]:
    """The tiny primary and fallback, both on one of llama.cpp's real templates, behind a
    proxy that knows them both."""
    path = {t.stem: t for t in templates()}[template]
    served = ["--jinja", "--chat-template-file", str(path), *args]
    first = start_server("primary", extra_args=served)
    second = start_server("fallback", extra_args=served)
    proxy = start_proxy(first.url, [second.url])
    proxy.servers_known()
    return first, second, proxy


def test_a_text_leg_sends_no_logprobs_the_client_did_not_ask_for(
    start_server: Callable[..., LlamaServer], start_proxy: Callable[..., Mitmdump]
) -> None:
    """The client set `timings_per_token` itself, so the first leg asks for no pieces
    (nothing to take out again); the native leg must not ask for them either."""
    first, _, proxy = templated_pair(start_server, start_proxy, QWEN3)
    body = {**SHAPES["plain"], "max_tokens": 300, "stream": True, "temperature": 0,
            "timings_per_token": True}  # fmt: skip
    stream = read_stream(proxy.url, body, on_chunk=lambda n: n == 8 and first.kill())
    assert_one_clean_stream(stream)
    assert "replayed as text" in stream.notes[0] and stream.segments[1]
    assert not [c for c in stream.chunks if any("logprobs" in ch for ch in c["choices"])]


def test_token_ids_of_the_primary_go_only_to_a_server_of_its_vocabulary(
    start_server: Callable[..., LlamaServer], start_proxy: Callable[..., Mitmdump]
) -> None:
    """A `logit_bias` by token id, the primary killed mid-answer: on a fallback of the
    same vocabulary the answer goes on; on one of another ("turns", whose ids are other
    tokens) it ends with the reason."""
    body = {**SHAPES["plain"], "max_tokens": 300, "stream": True, "temperature": 0,
            "logit_bias": {"400": -5}}  # fmt: skip
    for fallback, goes_on in (("fallback", True), ("turns-fallback", False)):
        first, second = start_server("primary"), start_server(fallback)
        proxy = start_proxy(first.url, [second.url])
        proxy.servers_known()
        stream = read_stream(proxy.url, body, on_chunk=lambda n, s=first: n == 8 and s.kill())
        if goes_on:
            assert_one_clean_stream(stream)
            assert stream.segments[1]
        else:
            (error,) = stream.errors
            message = error["error"]["message"]
            assert "logit_bias name token ids" in message and second.url in message, message


def test_half_of_a_utf16_pair_from_a_continuing_server_goes_to_the_client_as_sent(
    start_server: Callable[..., LlamaServer], start_proxy: Callable[..., Mitmdump]
) -> None:
    """Stand-in fallback (no real server here splits an emoji's escape on demand): its
    continuation carries a lone `\\ud83d`; the rewritten chunk reaches the client escaped
    as the server sent it, and the answer ends cleanly."""
    hosted = OpenAIUpstream("hosted", mode="surrogate")
    primary = start_server("primary")
    proxy = start_proxy(primary.url, [hosted.url])
    proxy.servers_known()
    body = {**SHAPES["plain"], "max_tokens": 300, "stream": True, "temperature": 0}
    stream = read_stream(proxy.url, body, on_chunk=lambda n: n == 8 and primary.kill())
    assert_one_clean_stream(stream)
    before, after = stream.segments
    asked = [*SHAPES["plain"]["messages"], {"role": "assistant", "content": before}]
    words = hosted.words(asked, 300 - stream.segment_tokens[0])
    words[HALF_PAIR_AT] += "\ud83d"
    assert after == "".join(words)
    hosted.close()


def test_a_logprobs_client_s_ids_are_replayed_only_when_none_were_held_back(
    start_server: Callable[..., LlamaServer], start_proxy: Callable[..., Mitmdump]
) -> None:
    """The client asks for logprobs and stops at " three xyz": llama-server holds " three"
    while it might start the stop and sends it with the next token's entry, which has
    that token's id alone. The held id never reached the client, so the answer's ids
    are not whole: the fallback (the same vocabulary) must go on from the text, as its
    own continuation of what the model wrote, not from ids one token short."""
    first, second, proxy = templated_pair(start_server, start_proxy, NEMO, "--ubatch-size", "32")
    body = {**SHAPES["plain"], "max_tokens": 300, "stream": True, "temperature": 0,
            "logprobs": True, "stop": [" three xyz"]}  # fmt: skip
    stream = read_stream(proxy.url, body, on_chunk=lambda n: n == 6 and first.kill())
    assert_one_clean_stream(stream)
    before, after = stream.segments
    assert " three model" in before, before
    # What the model wrote, by llama-server's own count: " three" came merged with the next
    # token's text, so one more than the client's chunks; more where another came merged,
    # or was held back when the cut landed (its text never reached the client).
    (handoff,) = proxy.status()["recent_handoffs"]
    assert handoff["at_token"] >= stream.segment_tokens[0] + 1
    request = {k: v for k, v in body.items() if k not in ("stream", "logprobs", "stop")}
    saw = httpx.post(f"{second.url}/apply-template", json=request).json()["prompt"]
    native = {"prompt": saw + before, "n_predict": 300 - handoff["at_token"],
              "temperature": 0, "cache_prompt": False, "stop": [" three xyz"]}  # fmt: skip
    own = httpx.post(f"{second.url}/completion", json=native, timeout=60).json()["content"]
    assert after == own


def spelled_then_plain(start_proxy, fallback: str, body: dict[str, Any], refused: str) -> None:
    """A stand-in primary writes ' the river' and then ' <|im_end|>' (no real model here
    writes a special token's text as ordinary pieces on demand), or ' bridge', and dies:
    the first ends in-band, its error saying `refused`; the second goes on at `fallback`."""
    for said, spells in ((" <|im_end|>", True), (" bridge", False)):
        events = (sse_chunk(role=True), sse_chunk(" the"), sse_chunk(" river"), sse_chunk(said))
        primary = FakeUpstream([(STREAM_HEAD + chunked(*events), 0)])
        try:
            proxy = start_proxy(primary.url, [fallback])
            proxy.servers_known()
            stream = read_stream(proxy.url, body)
            if spells:
                (error,) = stream.errors
                assert refused in error["error"]["message"], error
            else:
                assert_one_clean_stream(stream)
                assert stream.segments[0] == " the river bridge" and stream.segments[1]
        finally:
            primary.close()


def test_text_that_spells_a_special_token_of_the_fallback_is_not_sent_as_text(
    start_server: Callable[..., LlamaServer], start_proxy: Callable[..., Mitmdump]
) -> None:
    """Stand-in primary (no real model here writes `<|im_end|>` as ordinary pieces on
    demand) that dies after writing it; the fallback is a real llama-server, whose
    tokenizer would read that text as its end-of-turn token: the answer ends in-band
    with the reason, and a stand-in that writes plain words goes on."""
    fallback = start_server("fallback")
    body = {**SHAPES["plain"], "max_tokens": 20, "stream": True}
    spelled_then_plain(start_proxy, fallback.url, body, "spells '<|im_end|>'")


def _said(delta: dict[str, str]) -> bytes:
    """A stand-in's chat chunk carrying `delta` (reasoning or content)."""
    chunk = {"id": "chatcmpl-fake", "created": 1, "model": "fake",
             "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}  # fmt: skip
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _text(text: str) -> bytes:
    """A stand-in's text completion chunk."""
    chunk = {"id": "cmpl-fake", "created": 1, "model": "fake", "object": "text_completion",
             "choices": [{"index": 0, "text": text, "finish_reason": None}]}  # fmt: skip
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _spelled_error(stream: RawStream) -> str:
    (error,) = stream.errors
    message = error["error"]["message"]
    assert "spells '<|im_end|>'" in message, message
    return message


def test_reasoning_that_spells_a_special_token_is_not_sent_as_text(
    models: dict[str, Path], start_server: Callable[..., LlamaServer],
    start_proxy: Callable[..., Mitmdump],
) -> None:  # fmt: skip
    """The reasoning path (the raw output not known: a stand-in primary sends no pieces)
    asks too: a stand-in that dies while reasoning `<|im_end|>` as ordinary pieces, a
    real llama-server fallback on the tiny reasoning template, whose chat route renders
    the trailing message as the truth and would read that text as its end of turn."""
    template = str(reasoning_template(models["fallback"].parent))
    fallback = start_server("fallback", extra_args=["--chat-template-file", template])
    events = (sse_chunk(role=True), *(_said({"reasoning_content": t}) for t in
              (" the", " river", " <|im_end|>")))  # fmt: skip
    primary = FakeUpstream([(STREAM_HEAD + chunked(*events), 0)])
    proxy = start_proxy(primary.url, [fallback.url])
    proxy.servers_known()
    stream = read_stream(proxy.url, {**SHAPES["plain"], "max_tokens": 20, "stream": True})
    _spelled_error(stream)
    primary.close()


def test_a_text_completion_that_spells_a_special_token_is_not_sent_as_text(
    start_server: Callable[..., LlamaServer], start_proxy: Callable[..., Mitmdump]
) -> None:
    """`/v1/completions` goes on as its own dialect (no rendering to compare): the real
    llama-server fallback is asked all the same; plain words go on."""
    fallback = start_server("fallback")
    for said, spells in ((" <|im_end|>", True), (" bridge", False)):
        events = (_text(" the"), _text(" river"), _text(said))
        primary = FakeUpstream([(STREAM_HEAD + chunked(*events), 0)])
        proxy = start_proxy(primary.url, [fallback.url])
        proxy.servers_known()
        body = {"prompt": "Tell me about the river.", "max_tokens": 20, "stream": True}
        stream = read_stream(proxy.url, body, path="/v1/completions")
        if spells:
            _spelled_error(stream)
        else:
            assert stream.done == 1 and not stream.errors  # (text chunks have no role)
            assert stream.segments[0] == " the river bridge" and stream.segments[1]
        primary.close()


def test_a_router_is_asked_whether_text_spells_its_special_tokens(
    models: dict[str, Path], server_logs: Path, start_proxy: Callable[..., Mitmdump],
    tmp_path: Path,
) -> None:  # fmt: skip
    """A llama-server router answers `/tokenize` for the model named: asked as a
    llama-server is (it was not asked at all)."""
    directory = tmp_path / "router"
    directory.mkdir()
    (directory / "fallback.gguf").symlink_to(models["fallback"])
    router = LlamaRouter(directory, log_dir=server_logs).start()
    try:
        events = (sse_chunk(role=True), sse_chunk(" the"), sse_chunk(" river"),
                  sse_chunk(" <|im_end|>"))  # fmt: skip
        primary = FakeUpstream([(STREAM_HEAD + chunked(*events), 0)])
        proxy = start_proxy(primary.url, [router.url])
        assert proxy.servers_known()[router.url]["engine"] == "llama-server router"
        body = {**SHAPES["plain"], "model": "fallback", "max_tokens": 20, "stream": True}
        _spelled_error(read_stream(proxy.url, body))
        primary.close()
    finally:
        router.stop()


def test_llama_cpp_python_is_asked_whether_text_spells_its_special_tokens(
    models: dict[str, Path], server_logs: Path, start_proxy: Callable[..., Mitmdump]
) -> None:
    """llama-cpp-python's text route reads a prompt with its special tokens parsed: its
    own tokenizer, asked (`/extras/tokenize`, read back by `/extras/detokenize`, which
    drops a control token), tells; plain words go on."""
    fallback = LlamaCppPythonServer(models["fallback"], log_dir=server_logs).start(timeout=120)
    try:
        body = {**SHAPES["plain"], "max_tokens": 20, "stream": True}
        back = "' the river <|im_end|>', back as ' the river '"
        spelled_then_plain(start_proxy, fallback.url, body, back)
    finally:
        fallback.stop()
