"""Other engines behind the proxy: a server is asked to continue an answer only once it
has been seen to continue one. llama-cpp-python's server (a real one, on a copy of the
tiny fallback model) opens a new turn after a trailing assistant message, so it takes
new answers but never one that has sent text; llama-server continues, and is proven to."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from scripts.replay import read_flows
from scripts.testbed.llamacpppython import LlamaCppPythonServer
from scripts.testbed.llamaserver import LlamaRouter, LlamaServer
from scripts.testbed.processes import free_port
from scripts.testbed.prompts import PROMPT, chat_body
from tests.streams import assert_one_clean_stream, continuation, read_stream

LONG = 300


@pytest.fixture(scope="module")
def new_turner(models: dict[str, Path], server_logs: Path) -> Iterator[LlamaCppPythonServer]:
    server = LlamaCppPythonServer(models["fallback"], log_dir=server_logs).start(timeout=120)
    yield server
    server.stop()


def prompt_tokens(url: str, messages: list[dict[str, str]]) -> int:
    body = {"messages": messages, "max_tokens": 1, "temperature": 0}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    return reply["usage"]["prompt_tokens"]


def test_each_server_is_known_by_engine_and_by_whether_it_continues(
    start_proxy, primary: LlamaServer, fallback: LlamaServer, new_turner: LlamaCppPythonServer
) -> None:
    proxy = start_proxy(primary.url, [new_turner.url, fallback.url])
    servers = proxy.servers_known()
    assert servers[primary.url]["engine"] == "llama-server"
    assert servers[primary.url]["continues"] is True  # by its template, asked nothing else
    assert servers[fallback.url]["engine"] == "llama-server"
    assert servers[fallback.url]["continues"] is True
    other = servers[new_turner.url]
    assert other["engine"] == "llama-cpp-python"
    assert other["continues"] is False and "opens a new turn" in other["continues_why"]

    # What the check saw, asked of the engine directly: a trailing assistant message
    # grows its prompt by more than the message's own tokens (its turn is closed).
    def tokens(text: str) -> int:
        answer = httpx.post(f"{new_turner.url}/extras/tokenize", json={"input": text})
        return len(answer.json()["tokens"])

    alone = prompt_tokens(new_turner.url, [*PROMPT])
    partial = [*PROMPT, {"role": "assistant", "content": "The river"}]
    assert prompt_tokens(new_turner.url, partial) - alone > tokens("The river") - tokens("")


def test_an_engine_that_opens_a_new_turn_never_continues_an_answer(
    start_server, start_proxy, new_turner: LlamaCppPythonServer
) -> None:
    primary = start_server("primary")
    proxy = start_proxy(primary.url, [new_turner.url])
    proxy.servers_known()
    stream = read_stream(proxy.url, chat_body(LONG), on_chunk=lambda n: n == 40 and primary.kill())
    assert stream.status == 200 and stream.done == 0
    message = stream.errors[0]["error"]["message"]
    assert "no server could continue" in message
    assert f"not proven to continue an answer: {new_turner.url}" in message
    assert "opens a new turn" in message
    assert stream.segment_tokens[0] >= 39  # what was delivered stays delivered
    assert len(stream.segments) == 1  # and nothing of another answer follows it


def test_an_answer_passes_an_unproven_fallback_for_one_that_continues(
    start_server, start_proxy, fallback: LlamaServer, new_turner: LlamaCppPythonServer
) -> None:
    primary = start_server("primary")
    proxy = start_proxy(primary.url, [new_turner.url, fallback.url])
    proxy.servers_known()
    stream = read_stream(proxy.url, chat_body(LONG), on_chunk=lambda n: n == 40 and primary.kill())
    assert_one_clean_stream(stream)
    assert len(stream.notes) == 1 and f"-> {fallback.url}" in stream.notes[0]
    before, after = stream.segments
    assert after == continuation(fallback.url, before, LONG - stream.segment_tokens[0])


def test_an_unproven_engine_still_takes_a_new_answer(
    start_proxy, new_turner: LlamaCppPythonServer, tmp_path: Path
) -> None:
    """The primary is down before the first byte: nothing to continue, so the request goes
    to llama-cpp-python as the client sent it, but for the model name (its own, as an
    engine that checks names wants), and its own answer comes back whole."""
    flows_file = tmp_path / "flows.mitm"
    proxy = start_proxy(
        f"http://127.0.0.1:{free_port()}", [new_turner.url],
        options=[f"save_stream_file={flows_file}"],
    )  # fmt: skip
    own = proxy.servers_known()[new_turner.url]["models"][0]
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="none")
    chunks = client.chat.completions.create(
        model="any", messages=PROMPT, max_tokens=40, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    direct = openai.OpenAI(base_url=f"{new_turner.url}/v1", api_key="none")
    alone = direct.chat.completions.create(model=own, messages=PROMPT, max_tokens=40, temperature=0)
    assert text and text == alone.choices[0].message.content
    proxy.stop()  # the recording is whole
    (leg,) = [
        f for f in read_flows(flows_file)
        if f.metadata.get("spillover_exchange", {}).get("purpose") == "leg"
        and f.request.port == new_turner.port
    ]  # fmt: skip
    sent = json.loads(leg.request.content)
    assert sent["model"] == own and {**sent, "model": "any"} == {
        "model": "any",
        "messages": PROMPT,
        "max_tokens": 40,
        "temperature": 0,
        "stream": True,
    }


def test_a_llama_server_router_is_asked_in_its_own_model_name(
    models: dict[str, Path], server_logs: Path, start_server, start_proxy, tmp_path: Path
) -> None:
    """llama-server's router mode refuses a `model` it does not serve (the client's "any"
    here) and says 0 for its context: the fallback's own model name and slots are used."""
    directory = tmp_path / "router"
    directory.mkdir()
    (directory / "fallback.gguf").symlink_to(models["fallback"])
    router = LlamaRouter(directory, log_dir=server_logs).start()
    try:
        primary = start_server("primary")
        proxy = start_proxy(primary.url, [router.url])
        known = proxy.servers_known()[router.url]
        assert (known["engine"], known["models"]) == ("llama-server router", ["fallback"])
        assert known["continues"] is True and known["slot_context"] == 1024  # 4096 / 4
        body = chat_body(LONG, model="any")
        kill = lambda n: n == 40 and primary.kill()  # noqa: E731
        stream = read_stream(proxy.url, body, on_chunk=kill)
        assert_one_clean_stream(stream)
        before, after = stream.segments
        # The router's own continuation of the delivered text, asked directly.
        messages = [*PROMPT, {"role": "assistant", "content": before}]
        rendered = httpx.post(
            f"{router.url}/apply-template", json={"model": "fallback", "messages": messages}
        ).json()["prompt"]
        rest = LONG - stream.segment_tokens[0]
        direct = httpx.post(
            f"{router.url}/completion",
            json={"model": "fallback", "prompt": rendered, "n_predict": rest, "temperature": 0,
                  "cache_prompt": False},
            timeout=60,
        ).json()["content"]  # fmt: skip
        assert after == direct
    finally:
        router.stop()
