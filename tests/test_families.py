"""Models the proofs were not written for. The generator's second family ("turns": other
words in another order, other special tokens, a template that writes BOS itself and trims
every message, a tokenizer that adds BOS) and a ChatML model whose tokenizer adds a BOS
its template never writes ("chatml-bos", as some converters make them) are proven and
continued by each engine as the project's own "chatml" models are. What the client gets
after the cut is compared with that engine's own continuation, asked of it directly."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from scripts.testbed.llamacpppython import LlamaCppPythonServer
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.prompts import PROMPT, chat_body
from tests.streams import assert_one_clean_stream, continuation, read_stream
from tests.test_routing import wait_for
from tests.throttle import Throttled

LONG = 300
RENDERED = "a rendered prompt on /v1/completions"
QUICK = ["spillover_stall_s=1", "spillover_first_token_s=2"]
QUESTION = PROMPT[0]["content"]
# Each family's chat prompt, written out by hand from its template, as a text route
# reads it: BOS is the tokenizer's to add.
WRITTEN_OUT = {
    "turns": f"<|user|>\n{QUESTION}<|end|>\n<|assistant|>\n",
    "chatml-bos": f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n",
}
FALLBACK_OF = {"turns": "turns-fallback", "chatml-bos": "bos-fallback"}
OTHER_FAMILIES = list(WRITTEN_OUT)


def tokenize(server: LlamaServer, text: str, special: bool = False) -> list[int]:
    body = {"content": text, "add_special": special, "parse_special": True}
    return httpx.post(f"{server.url}/tokenize", json=body).json()["tokens"]


def test_the_families_differ_where_real_models_do(start_server) -> None:
    """What the generator claims of each family, asked of llama-server: other ids for the
    same text, BOS added by the tokenizer or not, a template that trims."""
    chatml, turns, bos = (start_server(m) for m in ("fallback", "turns-fallback", "bos-fallback"))
    text = "the river and the bridge"
    assert tokenize(chatml, text) != tokenize(turns, text)
    assert tokenize(chatml, text) == tokenize(bos, text)  # one vocabulary
    assert tokenize(chatml, "", special=True) == []
    assert tokenize(turns, "", special=True) == tokenize(bos, "", special=True) == [1]
    spaced = [{"role": "user", "content": "  the river \n\n"}]
    rendered = {
        s: httpx.post(f"{s.url}/apply-template", json={"messages": spaced}).json()["prompt"]
        for s in (chatml, turns)
    }
    assert "  the river \n\n<|im_end|>" in rendered[chatml]
    assert "<|user|>\nthe river<|end|>" in rendered[turns]


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_llama_server_of_another_family_continues_a_cut_answer(
    family: str, start_server, start_proxy
) -> None:
    """From a chatml primary: to another vocabulary the answer goes on as text; to the
    same vocabulary whose tokenizer adds BOS, as the same ids after the fallback's own
    rendering of the prompt (BOS and all). Either way what follows the cut is that
    server's own continuation of the text delivered."""
    primary = start_server("primary")
    fallback = start_server(FALLBACK_OF[family])
    proxy = start_proxy(primary.url, [fallback.url], options=QUICK)
    known = proxy.servers_known()
    assert known[fallback.url]["continues_by"] == "a trailing assistant message"
    same_ids = known[fallback.url]["tokenizer"] == known[primary.url]["tokenizer"]
    assert same_ids == (family == "chatml-bos")
    stream = read_stream(proxy.url, chat_body(LONG), on_chunk=lambda n: n == 40 and primary.kill())
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    replay = "replayed as token ids" if same_ids else "replayed as text"
    assert f"{primary.url} -> {fallback.url}" in note and replay in note
    before, after = stream.segments
    assert after == continuation(fallback.url, before, LONG - stream.segment_tokens[0])


def test_within_the_turns_family_an_answer_goes_on_from_its_token_ids(
    start_server, start_proxy
) -> None:
    """Both servers of the turns family: one tokenizer, whose BOS the template writes, so
    the ids the fallback goes on from open with exactly one BOS, as its own do."""
    primary = start_server("turns-primary")
    fallback = start_server("turns-fallback")
    proxy = start_proxy(primary.url, [fallback.url], options=QUICK)
    known = proxy.servers_known()
    assert known[fallback.url]["tokenizer"] == known[primary.url]["tokenizer"]
    stream = read_stream(proxy.url, chat_body(LONG), on_chunk=lambda n: n == 40 and primary.kill())
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert "replayed as token ids" in note
    before, after = stream.segments
    assert after == continuation(fallback.url, before, LONG - stream.segment_tokens[0])


@pytest.fixture(scope="module", params=OTHER_FAMILIES)
def new_turner(
    request: pytest.FixtureRequest, models: dict[str, Path], server_logs: Path
) -> Iterator[tuple[str, LlamaCppPythonServer]]:
    """llama-cpp-python serving another family's model."""
    family = request.param
    server = LlamaCppPythonServer(models[FALLBACK_OF[family]], log_dir=server_logs)
    server.start(timeout=120)
    yield family, server
    server.stop()


def chat_prompt_tokens(url: str) -> int:
    body = {"messages": PROMPT, "max_tokens": 1, "temperature": 0}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["usage"][
        "prompt_tokens"
    ]


def text_completion(url: str, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()


def test_llama_cpp_python_of_another_family_continues_its_own_rendered_prompt(
    new_turner: tuple[str, LlamaCppPythonServer], start_server, start_proxy
) -> None:
    """llama-cpp-python's chat route reads the rendering as it is; its text route puts the
    tokenizer's BOS before any prompt. For the turns template (which writes BOS) the addon
    leaves the template's BOS to the text route; for chatml-bos the text route's BOS is
    the one difference, and said. Either way the text after the cut is the engine's own
    text completion of the prompt written out by hand and the text delivered."""
    family, server = new_turner
    # What the proof rests on, asked of the engine directly.
    chat, text = chat_prompt_tokens(server.url), text_completion(server.url, WRITTEN_OUT[family], 1)
    assert text["usage"]["prompt_tokens"] == chat + (family == "chatml-bos")

    primary = start_server("primary")
    proxy = start_proxy(primary.url, [server.url], options=QUICK)
    known = proxy.servers_known()[server.url]
    assert known["continues"] is True and known["continues_by"] == RENDERED, known
    said = {
        "turns": "its text route adds the BOS the template writes",
        "chatml-bos": "but for the BOS its text route adds",
    }[family]
    assert said in known["continues_why"]
    stream = read_stream(proxy.url, chat_body(LONG), on_chunk=lambda n: n == 40 and primary.kill())
    assert_one_clean_stream(stream)
    before, after = stream.segments
    rest = LONG - stream.segment_tokens[0]
    assert (
        after
        == text_completion(server.url, WRITTEN_OUT[family] + before, rest)["choices"][0]["text"]
    )


def test_token_ids_of_two_vocabularies_never_mix(start_server, start_proxy) -> None:
    """chatml -> turns -> chatml, the client asking for logprobs (so every leg reports
    its ids). The second leg's ids are the turns tokenizer's: the third server, which
    shares the first one's tokenizer, must get the answer as text, and what follows the
    second cut is its own continuation of all the text delivered."""
    # One slot of 4,096 tokens each and a long answer, the first two servers throttled,
    # so that neither has written the whole of it by the time the client (on a loaded
    # machine) reaches the chunk that cuts it.
    servers = [start_server(m, slots=1) for m in ("primary", "turns-fallback", "fallback")]
    first, second, third = servers
    proxy = start_proxy(first.url, [second.url, third.url], options=QUICK)
    known = proxy.servers_known()
    assert known[first.url]["tokenizer"] == known[third.url]["tokenizer"]
    assert known[second.url]["tokenizer"] != known[first.url]["tokenizer"]

    def cut(n: int) -> None:
        if n == 30:
            first.kill()
        elif n == 400:
            second.kill()

    whole = 2000
    with Throttled(first.pid, second.pid):
        stream = read_stream(proxy.url, chat_body(whole, logprobs=True), on_chunk=cut)
    assert_one_clean_stream(stream)
    to_second, to_third = stream.notes
    assert f"{first.url} -> {second.url}" in to_second and "replayed as text" in to_second
    assert f"{second.url} -> {third.url}" in to_third and "replayed as text" in to_third
    before = "".join(stream.segments[:2])
    rest = whole - sum(stream.segment_tokens[:2])
    assert stream.segments[2] == continuation(third.url, before, rest)


@pytest.mark.parametrize("health_s", [0, 1])
def test_a_fallback_restarted_with_another_model_is_learnt_again_before_it_continues(
    health_s: int, models: dict[str, Path], server_logs: Path, start_server, start_proxy
) -> None:
    """The fallback was proven with the primary's vocabulary, then restarted on the same
    port with another. With health checks off, nothing tells the proxy but the check made
    right before the continuation is sent; with them on, it sees the server down, and
    learns the new model as soon as it answers again. Either way the answer goes on as
    text, and what follows the cut is the new model's own continuation."""
    primary = start_server("primary")
    fallback = start_server("fallback")
    proxy = start_proxy(
        primary.url, [fallback.url], options=[*QUICK, f"spillover_health_s={health_s}"]
    )
    proven = proxy.servers_known()
    assert proven[fallback.url]["tokenizer"] == proven[primary.url]["tokenizer"]
    fallback.stop()
    if health_s:
        wait_for(proxy, fallback.url, "down")
    other = LlamaServer(models["turns-fallback"], port=fallback.port, log_dir=server_logs).start()
    try:
        if health_s:
            deadline = time.monotonic() + 10
            while proxy.servers_known()[other.url]["tokenizer"] == proven[other.url]["tokenizer"]:
                assert time.monotonic() < deadline, "the restarted server was never learnt again"
                time.sleep(0.05)
        stream = read_stream(
            proxy.url, chat_body(LONG), on_chunk=lambda n: n == 40 and primary.kill()
        )
        assert_one_clean_stream(stream)
        (note,) = stream.notes
        assert f"{primary.url} -> {other.url}" in note and "replayed as text" in note
        before, after = stream.segments
        assert after == continuation(other.url, before, LONG - stream.segment_tokens[0])
        learnt = proxy.servers_known()[other.url]
        assert learnt["tokenizer"] != proven[other.url]["tokenizer"]
        assert learnt["identity"] != proven[other.url]["identity"]
    finally:
        other.stop()
