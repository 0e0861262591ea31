"""Other engines behind the proxy: a server is asked to continue an answer only once it
has been seen to continue one. llama-cpp-python's server (a real one, on a copy of the
tiny fallback model) opens a new turn after a trailing assistant message, asked either
way, but continues a text completion of its own chat prompt: the addon renders that from
the template in the GGUF the server names as its model, once it has seen the server read
the rendering as its chat route reads its own prompt. Given another template, it is not
used for a started answer. llama-server continues, and is proven to."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from scripts.parts.processes import free_port
from scripts.testbed.llamacpppython import LlamaCppPythonServer
from scripts.testbed.llamaserver import LlamaRouter, LlamaServer
from scripts.testbed.memfiles import FakeCard
from scripts.testbed.mitm import watch_sysfs
from scripts.testbed.prompts import PROMPT, chat_body
from scripts.testbed.replay import leg_flows
from tests.streams import assert_one_clean_stream, continuation, read_stream

LONG = 300
RENDERED = "a rendered prompt on /v1/completions"
# The tiny models' ChatML template, written out: what the addon must render from the GGUF.
CHATML_PROMPT = f"<|im_start|>user\n{PROMPT[0]['content']}<|im_end|>\n<|im_start|>assistant\n"
QUICK = ["spillover_stall_s=1", "spillover_first_token_s=2"]


@pytest.fixture(scope="module")
def new_turner(models: dict[str, Path], server_logs: Path) -> Iterator[LlamaCppPythonServer]:
    server = LlamaCppPythonServer(models["fallback"], log_dir=server_logs).start(timeout=120)
    yield server
    server.stop()


@pytest.fixture
def other_template(tmp_path: Path) -> Path:
    """A tokenizer_config.json with a template not the model's (Llama 2's turns)."""
    config = tmp_path / "tokenizer_config.json"
    template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + "
        "m['content'] + ' [/INST]' }}{% else %}{{ ' ' + m['content'] + eos_token }}"
        "{% endif %}{% endfor %}"
    )
    config.write_text(json.dumps({"chat_template": template, "bos_token": "<s>",
                                  "eos_token": "</s>"}))  # fmt: skip
    return config


def prompt_tokens(url: str, messages: list[dict[str, str]]) -> int:
    body = {"messages": messages, "max_tokens": 1, "temperature": 0}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    return reply["usage"]["prompt_tokens"]


def own_completion(url: str, prompt: str, max_tokens: int) -> str:
    """llama-cpp-python's own text completion of `prompt`, asked directly."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    return reply["choices"][0]["text"]


def test_each_server_is_known_by_engine_and_by_how_it_continues(
    start_proxy, primary: LlamaServer, fallback: LlamaServer, new_turner: LlamaCppPythonServer
) -> None:
    proxy = start_proxy(primary.url, [new_turner.url, fallback.url])
    servers = proxy.servers_known()
    assert servers[primary.url]["engine"] == "llama-server"
    assert servers[primary.url]["continues"] is True  # by its template, asked nothing else
    assert servers[fallback.url]["engine"] == "llama-server"
    assert servers[fallback.url]["continues_by"] == "a trailing assistant message"
    other = servers[new_turner.url]
    assert other["engine"] == "llama-cpp-python"
    assert other["continues"] is True and other["continues_by"] == RENDERED
    assert other["template_from"] == other["model"]  # the GGUF it serves
    trailing, final, rendered = other["continues_why"].split("; ")
    assert trailing.startswith("a trailing assistant message: the message adds")
    assert final.startswith("continue_final_message: the message adds")
    assert trailing.endswith("it opens a new turn") and final.endswith("it opens a new turn")
    assert rendered.startswith(f"{RENDERED}: the template from {other['model']} renders")

    # What the check saw, asked of the engine directly: a trailing assistant message
    # grows its prompt by more than the message's own tokens (its turn is closed), and
    # its chat prompt is the ChatML the GGUF's template makes.
    def tokens(text: str) -> int:
        answer = httpx.post(f"{new_turner.url}/extras/tokenize", json={"input": text})
        return len(answer.json()["tokens"])

    alone = prompt_tokens(new_turner.url, [*PROMPT])
    partial = [*PROMPT, {"role": "assistant", "content": "The river"}]
    assert prompt_tokens(new_turner.url, partial) - alone > tokens("The river") - tokens("")
    completion = {"prompt": CHATML_PROMPT, "max_tokens": 1}
    counted = httpx.post(f"{new_turner.url}/v1/completions", json=completion, timeout=60)
    assert counted.json()["usage"]["prompt_tokens"] == alone


def cut_primary(how: str, primary: LlamaServer, card: FakeCard):
    """What cuts the primary at the client's 40th chunk."""
    act = {
        "killed": primary.kill,
        "stalled": lambda: os.kill(primary.pid, signal.SIGSTOP),
        "pressured": lambda: card.set_used(16000),
    }[how]
    return lambda n: n == 40 and act()


@pytest.mark.parametrize("how", ["killed", "stalled", "pressured"])
def test_a_cut_answer_goes_on_as_llama_cpp_pythons_own_text_completion(
    how: str, start_server, start_proxy, new_turner: LlamaCppPythonServer, tmp_path: Path
) -> None:
    primary = start_server("primary")
    sysfs = tmp_path / "sys"
    card = FakeCard(sysfs, "card0", total_mib=16384, used_mib=10000)
    FakeCard(sysfs, "card1", total_mib=8192, used_mib=2000)
    options = [*QUICK, *watch_sysfs(sysfs, {primary.url: "drm:card0", new_turner.url: "drm:card1"})]
    proxy = start_proxy(primary.url, [new_turner.url], options=options)
    proxy.servers_known()
    try:
        stream = read_stream(proxy.url, chat_body(LONG), on_chunk=cut_primary(how, primary, card))
    finally:
        if how == "stalled":
            os.kill(primary.pid, signal.SIGCONT)
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert f"{primary.url} -> {new_turner.url}" in note
    before, after = stream.segments
    rest = LONG - stream.segment_tokens[0]
    assert after == own_completion(new_turner.url, CHATML_PROMPT + before, rest)


def test_an_engine_whose_template_is_not_known_never_continues_an_answer(
    start_server, start_proxy, new_turner: LlamaCppPythonServer, other_template: Path
) -> None:
    """Named another template, the check finds its rendering is not what the server reads:
    the answer ends with an error that says so, after what was delivered."""
    primary = start_server("primary")
    option = f"spillover_templates={new_turner.url}={other_template}"
    proxy = start_proxy(primary.url, [new_turner.url], options=[option])
    known = proxy.servers_known()[new_turner.url]
    assert known["continues"] is False and known["template_from"] == str(other_template)
    assert f"the template from {other_template} renders a prompt of" in known["continues_why"]
    assert known["continues_why"].endswith("not its template")
    stream = read_stream(proxy.url, chat_body(LONG), on_chunk=lambda n: n == 40 and primary.kill())
    assert stream.status == 200 and stream.done == 0
    message = stream.errors[0]["error"]["message"]
    assert "no server could continue" in message
    assert f"not proven to continue an answer: {new_turner.url}" in message
    assert "opens a new turn" in message and "not its template" in message
    assert stream.segment_tokens[0] >= 39  # what was delivered stays delivered
    assert len(stream.segments) == 1  # and nothing of another answer follows it


def test_an_answer_passes_an_unproven_fallback_for_one_that_continues(
    start_server, start_proxy, fallback: LlamaServer, new_turner: LlamaCppPythonServer,
    other_template: Path,
) -> None:  # fmt: skip
    primary = start_server("primary")
    option = f"spillover_templates={new_turner.url}={other_template}"
    proxy = start_proxy(primary.url, [new_turner.url, fallback.url], options=[option])
    proxy.servers_known()
    stream = read_stream(proxy.url, chat_body(LONG), on_chunk=lambda n: n == 40 and primary.kill())
    assert_one_clean_stream(stream)
    assert len(stream.notes) == 1 and f"-> {fallback.url}" in stream.notes[0]
    before, after = stream.segments
    assert after == continuation(fallback.url, before, LONG - stream.segment_tokens[0])


def test_a_new_answer_goes_to_another_engine_as_the_client_sent_it(
    start_proxy, new_turner: LlamaCppPythonServer, tmp_path: Path
) -> None:
    """The primary is down before the first byte: nothing to continue, so the request goes
    to llama-cpp-python's chat route as the client sent it, but for the model name (its
    own, as an engine that checks names wants), and its own answer comes back whole."""
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
    (leg,) = leg_flows(flows_file, new_turner.port)
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
    here) and says 0 for its context: the model spillover_models names (of the two it
    serves; the first it lists otherwise) and that model's slots are used."""
    directory = tmp_path / "router"
    directory.mkdir()
    (directory / "fallback.gguf").symlink_to(models["fallback"])
    (directory / "small.gguf").symlink_to(models["fallback"])
    router = LlamaRouter(directory, log_dir=server_logs).start()
    try:
        primary = start_server("primary")
        proxy = start_proxy(
            primary.url, [router.url], options=[f"spillover_models={router.url}=small"]
        )
        known = proxy.servers_known()[router.url]
        assert known["engine"] == "llama-server router"
        assert sorted(known["models"]) == ["fallback", "small"] and known["model"] == "small"
        assert known["continues"] is True and known["slot_context"] == 1024  # 4096 / 4
        loaded = httpx.get(f"{router.url}/v1/models").json()["data"]
        assert [m["id"] for m in loaded if m["status"]["value"] == "loaded"] == ["small"]
        body = chat_body(LONG, model="any")
        kill = lambda n: n == 40 and primary.kill()  # noqa: E731
        stream = read_stream(proxy.url, body, on_chunk=kill)
        assert_one_clean_stream(stream)
        before, after = stream.segments
        # The router's own continuation of the delivered text, asked directly.
        messages = [*PROMPT, {"role": "assistant", "content": before}]
        rendered = httpx.post(
            f"{router.url}/apply-template", json={"model": "small", "messages": messages}
        ).json()["prompt"]
        rest = LONG - stream.segment_tokens[0]
        direct = httpx.post(
            f"{router.url}/completion",
            json={"model": "small", "prompt": rendered, "n_predict": rest, "temperature": 0,
                  "cache_prompt": False},
            timeout=60,
        ).json()["content"]  # fmt: skip
        assert after == direct
    finally:
        router.stop()


def test_a_client_that_sets_no_limit_gets_the_rest_of_the_context_after_the_cut(
    models: dict[str, Path], server_logs: Path, start_server, start_proxy
) -> None:
    """Most chat UIs send no max_tokens. llama-cpp-python's text route stops at 16 tokens
    unless told otherwise, where its chat route (and the client's own answer) goes on to
    the end of the context: the continuation names the limit, and the client gets the
    engine's own completion to the end of its context."""
    short = LlamaCppPythonServer(models["fallback"], ctx_size=512, log_dir=server_logs)
    short.start(timeout=120)
    try:
        primary = start_server("primary")
        proxy = start_proxy(primary.url, [short.url], options=QUICK)
        assert proxy.servers_known()[short.url]["continues_by"] == RENDERED
        body = {k: v for k, v in chat_body(LONG).items() if k != "max_tokens"}
        stream = read_stream(proxy.url, body, on_chunk=lambda n: n == 40 and primary.kill())
        assert_one_clean_stream(stream)
        before, after = stream.segments
        assert stream.finishes == ["length"] and stream.segment_tokens[1] > 300
        reply = httpx.post(
            f"{short.url}/v1/completions",
            json={"prompt": CHATML_PROMPT + before, "max_tokens": None, "temperature": 0},
            timeout=120,
        ).json()
        assert after == reply["choices"][0]["text"]
    finally:
        short.stop()
