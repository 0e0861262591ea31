"""A template that prints the date (Llama 3.2's "Today Date"), served by servers whose
clocks keep zones 26 hours apart (UTC+14 and UTC-12: never the same date), as a fallback
on another host may: the answer goes on from the prompt the model saw, with the first
server's date, not the next one's own rendering of the request on its day; llama-server
to llama-server, llama-server to vLLM (its ids of the primary's rendering) and vLLM to
llama-server (the vLLM's rendering as text). Where the primary's rendering could not be
had as its answer began (a relay answers its /apply-template 503, as a server in
trouble may), the date the model read is not known: the answer ends in-band."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from scripts.testbed.llamacppfiles import templates
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.mitm import Mitmdump
from scripts.testbed.relay import Relay
from scripts.testbed.vllmserver import (
    SERVED_NAME,
    VllmServer,
    hf_copy,
)
from tests.chat_shapes import SHAPES
from tests.streams import assert_one_clean_stream, read_stream
from tests.test_raw_output import (
    ANSWER,
    CUT,
    SAME_BATCHES,
    continued,
    pieces,
    read_cut,
    rendered,
    text_of,
)
from tests.throttle import Throttled
from tests.vllmhere import vllm_or_skip

LLAMA32 = "meta-llama-Llama-3.2-3B-Instruct"
LONG = 300  # a vLLM on the CPU is still writing when a handoff asked at chunk CUT lands


class Zoned(LlamaServer):
    def __init__(self, model: Path, zone: str, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.zone = zone

    def environment(self) -> dict[str, str]:
        return {**os.environ, "TZ": self.zone}


@pytest.fixture
def zoned(models: dict[str, Path], server_logs: Path) -> Iterator[Callable[[str], LlamaServer]]:
    started: list[LlamaServer] = []
    template = {t.stem: t for t in templates()}[LLAMA32]
    args = ["--jinja", "--chat-template-file", str(template), *SAME_BATCHES]

    def start(zone: str) -> LlamaServer:
        server = Zoned(models["primary"], zone, extra_args=args, log_dir=server_logs)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


def test_the_fallback_reads_the_date_the_model_saw(
    zoned: Callable[[str], LlamaServer], start_proxy: Callable[..., Mitmdump]
) -> None:
    first, second = zoned("Etc/GMT-14"), zoned("Etc/GMT+12")
    body = {**SHAPES["plain"], "max_tokens": ANSWER, "stream": True, "temperature": 0}
    saw = rendered(first, body)
    assert saw != rendered(second, body), "both servers print the same date"
    proxy = start_proxy(first.url, [second.url])
    proxy.servers_known()
    wrote = pieces(first, body)
    stream = read_cut(proxy, body, [first], (CUT,))
    assert_one_clean_stream(stream)
    assert "replayed as token ids" in stream.notes[0], stream.notes
    said = stream.segment_tokens[0]
    own = continued(second, [saw, *(piece.id for piece in wrote[:said])], ANSWER - said)
    assert stream.segments[1] == text_of(own) and text_of(own)


class Refusing(Relay):
    """HAProxy in front of a server, every route let through but `/apply-template`,
    which it answers 503: a primary whose rendering cannot be had as the answer starts
    (already in trouble), while its answer streams."""

    def argv(self) -> list[str]:
        argv = super().argv()
        config = self.config.read_text().replace(
            "    default_backend server\n",
            '    http-request return status 503 content-type text/plain string "busy" '
            "if { path /apply-template }\n    default_backend server\n",
        )
        self.config.write_text(config)
        return argv


def test_a_date_the_model_read_that_is_not_known_is_not_replaced(
    zoned: Callable[[str], LlamaServer], start_proxy: Callable[..., Mitmdump], server_logs: Path
) -> None:
    """The primary's rendering could not be asked as its answer began: the fallback,
    whose template prints the date too, would put its own date where the model read
    another. The answer ends in-band saying so."""
    first, second = zoned("Etc/GMT-14"), zoned("Etc/GMT+12")
    relay = Refusing(first.url, log_dir=server_logs, every_route=True).start()
    try:
        proxy = start_proxy(relay.url, [second.url])
        assert proxy.servers_known()[relay.url]["dated_template"]
        body = {**SHAPES["plain"], "max_tokens": LONG, "stream": True, "temperature": 0}
        with Throttled(first.pid):  # (run free, it writes the whole answer before chunk CUT)
            stream = read_stream(proxy.url, body, on_chunk=lambda n: n == CUT and first.kill())
    finally:
        relay.stop()
    assert stream.segments[0] and stream.done == 0
    (error,) = stream.errors
    assert "the date the model read is not known" in error["error"]["message"]
    assert "HTTP 503" in error["error"]["message"]


@pytest.fixture(scope="module")
def dated_vllm(models: dict[str, Path], server_logs: Path) -> Iterator[VllmServer]:
    """vLLM on the primary's weights with Llama 3.2's template, its clock 26 hours from
    the primary's (UTC-12)."""
    vllm_or_skip()
    template = {t.stem: t for t in templates()}[LLAMA32]
    server = ZonedVllm(
        hf_copy(models["primary"]), max_model_len=1024, log_dir=server_logs,
        extra_args=["--chat-template", str(template)],
    ).start(timeout=300)  # fmt: skip
    yield server
    server.stop()


class ZonedVllm(VllmServer):
    def environment(self) -> dict[str, str]:
        return {**super().environment(), "TZ": "Etc/GMT+12"}


def test_a_vllm_goes_on_from_the_date_the_model_read(
    zoned: Callable[[str], LlamaServer],
    dated_vllm: VllmServer,
    start_proxy: Callable[..., Mitmdump],
) -> None:
    """A llama-server of Llama 3.2's template at UTC+14, a vLLM of the same template at
    UTC-12: the vLLM goes on from its ids of the primary's rendering (its own date is
    another), as it goes on when asked directly."""
    first = zoned("Etc/GMT-14")
    body = {**SHAPES["plain"], "max_tokens": ANSWER, "stream": True, "temperature": 0}
    saw = rendered(first, body)
    model = {"model": SERVED_NAME}
    own = httpx.post(f"{dated_vllm.url}/tokenize", json={**model, "messages": body["messages"],
                     "add_generation_prompt": True}).json()["tokens"]  # fmt: skip
    assert own != tokens(dated_vllm, saw), "both servers print the same date"
    proxy = start_proxy(first.url, [dated_vllm.url])
    known = proxy.servers_known()
    assert known[first.url]["dated_template"] == known[dated_vllm.url]["dated_template"]
    stream = read_cut(proxy, body, [first], (CUT,))
    assert_one_clean_stream(stream)
    said = stream.segment_tokens[0]  # (one token a chunk on llama-server's chat route)
    prompt = tokens(dated_vllm, saw + stream.segments[0])
    if "replayed as token ids" in stream.notes[0]:
        prompt = tokens(dated_vllm, saw) + [p.id for p in pieces(first, body)[:said]]
    asked = {**model, "prompt": prompt, "max_tokens": ANSWER - said, "temperature": 0}
    direct = httpx.post(f"{dated_vllm.url}/v1/completions", json=asked, timeout=120).json()
    assert stream.segments[1] == direct["choices"][0]["text"] and stream.segments[1]


def tokens(server: VllmServer, text: str) -> list[int]:
    asked = {"model": SERVED_NAME, "prompt": text, "add_special_tokens": False}
    return httpx.post(f"{server.url}/tokenize", json=asked).json()["tokens"]


def test_a_llama_server_goes_on_from_the_date_a_vllm_primary_printed(
    zoned: Callable[[str], LlamaServer],
    dated_vllm: VllmServer,
    start_proxy: Callable[..., Mitmdump],
) -> None:
    """The other way: the vLLM (UTC-12) first, its rendering as text asked as the answer
    starts; the llama-server (UTC+14) goes on from that text, not its own rendering."""
    second = zoned("Etc/GMT-14")
    body = {**SHAPES["plain"], "max_tokens": LONG, "stream": True, "temperature": 0}
    asked = {"model": SERVED_NAME, "messages": body["messages"], "add_generation_prompt": True}
    ids = httpx.post(f"{dated_vllm.url}/tokenize", json=asked).json()["tokens"]
    detokenized = {"model": SERVED_NAME, "tokens": ids}
    saw = httpx.post(f"{dated_vllm.url}/detokenize", json=detokenized).json()["prompt"]
    assert saw != rendered(second, body), "both servers print the same date"
    proxy = start_proxy(dated_vllm.url, [second.url])
    proxy.servers_known()
    url = proxy.url
    cut = lambda n: n == CUT and httpx.post(f"{url}/spillover/handoff")  # noqa: E731
    stream = read_stream(url, {**body, "model": SERVED_NAME}, on_chunk=cut)
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    # (a vLLM chunk may carry more than one token: the count is the proxy's)
    (handoff,) = httpx.get(f"{url}/spillover/status").json()["recent_handoffs"]
    said = handoff["at_token"]
    if "replayed as token ids" in note:
        whole = {**body, "model": SERVED_NAME, "stream": False, "return_token_ids": True}
        answer = httpx.post(f"{dated_vllm.url}/v1/chat/completions", json=whole, timeout=120)
        prompt = [saw, *answer.json()["choices"][0]["token_ids"][:said]]
    else:
        prompt = [saw + stream.segments[0]]
    assert stream.segments[1] == text_of(continued(second, prompt, LONG - said))
