"""A real vLLM (its CPU build, on an HF copy of the tiny fallback model) on either side of
a handoff. vLLM opens a new turn after a trailing assistant message unless asked with
`continue_final_message`: the addon finds that out by itself, asks it that way, and
what the client gets after the cut is vLLM's own continuation, asked of it directly. The
other way round, a vLLM primary cut mid-answer is continued by llama-server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from addon.formats.chat import Chat
from addon.formats.transcript import Transcript
from addon.handoff import seen
from addon.handoff.nextleg import CannotContinue, NextLeg
from addon.handoff.seen import prefill_echoed
from addon.handoff.vllm import VllmTerms
from addon.servers.directory import ServerDirectory
from addon.servers.engines import CHAT_RENDERING
from addon.servers.framing import ChunkedBody
from addon.servers.upstream import Upstream
from addon.servers.vllm_routes import OFF
from scripts.testbed.llamacppfiles import templates
from scripts.testbed.llamacpppython import LlamaCppPythonServer
from scripts.testbed.llamaserver import LlamaServer, find_binary
from scripts.testbed.memfiles import FakeCard
from scripts.testbed.mitm import watch_sysfs
from scripts.testbed.prompts import PROMPT, chat_body
from scripts.testbed.relay import Relay
from scripts.testbed.scripted_upstream import STREAM_HEAD, FakeUpstream, chunked, sse_chunk
from scripts.testbed.tinymodels import reasoning_template
from scripts.testbed.vllmserver import (
    SERVED_NAME,
    VllmServer,
    hf_copy,
    kill_vllm,
)
from scripts.testbed.vllmserver import command as vllm_command
from scripts.testbed.workers import SpilloverWorkers, haproxy_missing
from tests.chat_shapes import SHAPES, transcript
from tests.quickstart import (
    PROXY,
    doc_block,
    quick_start_ports,
    running_as_written,
    wait_until_ready,
    your_models,
)
from tests.streams import (
    RawStream,
    assert_one_clean_stream,
    continuation,
    direct_text,
    read_stream,
)
from tests.tap import tapped
from tests.test_leg_fields import spelled_then_plain
from tests.test_prefill import built_continuation
from tests.test_routing import live_on
from tests.test_splice import held
from tests.throttle import Throttled
from tests.vllmhere import vllm_or_skip
from watchers.listeners import descendants, listening_pids

# vLLM takes minutes to start on 2 cores beside the other tests: the first test waits.
pytestmark = pytest.mark.timeout(420)
LONG = 300
QUICK_LONG = 1500
# The module's vLLM context: room for every test's prompt and answer, and short enough
# that an answer without a limit (which runs to it, three times) takes seconds, not minutes.
CONTEXT = 1024
FINAL = {"continue_final_message": True, "add_generation_prompt": False}


@pytest.fixture(scope="module")
def vllm(models: dict[str, Path], server_logs: Path) -> Iterator[VllmServer]:
    vllm_or_skip()
    model_dir = hf_copy(models["fallback"])
    server = VllmServer(model_dir, max_model_len=CONTEXT, log_dir=server_logs).start(timeout=300)
    yield server
    server.stop()


def vllm_continuation(url: str, before: str, max_tokens: int) -> str:
    """vLLM's own continuation of what the model saw and wrote, computed directly: its
    token ids of the question (its template, generation prompt on), their text, then
    `before`, as its text route reads them."""
    asked = {"model": SERVED_NAME, "messages": PROMPT, "add_generation_prompt": True}
    saw = httpx.post(f"{url}/tokenize", json=asked).json()["tokens"]
    text = httpx.post(f"{url}/detokenize", json={"model": SERVED_NAME, "tokens": saw}).json()
    truth = {"model": SERVED_NAME, "prompt": text["prompt"] + before, "add_special_tokens": False}
    ids = httpx.post(f"{url}/tokenize", json=truth).json()["tokens"]
    body = {"model": SERVED_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    return reply["choices"][0]["text"]


def prompt_count(url: str, messages: list[dict[str, str]], **fields: bool) -> int:
    body = {"model": SERVED_NAME, "messages": messages, **fields}
    return httpx.post(f"{url}/tokenize", json=body).json()["count"]


def test_vllm_is_known_and_continues_by_continue_final_message(
    start_proxy, primary: LlamaServer, vllm: VllmServer
) -> None:
    proxy = start_proxy(primary.url, [vllm.url])
    known = proxy.servers_known()[vllm.url]
    assert (known["engine"], known["models"]) == ("vllm", [SERVED_NAME])
    assert known["continues"] is True and known["continues_by"] == "continue_final_message"
    said = known["continues_why"].split("; ")
    assert said[0].startswith("a trailing assistant message: the message adds")
    assert said[0].endswith("it opens a new turn")
    assert said[1] == "continue_final_message adds no more than its own tokens to the prompt"
    assert known["slot_context"] == CONTEXT  # its max_model_len
    assert known["own_routes"] == OFF  # started without --enable-scale-out
    # What the check rests on, asked of vLLM directly: a trailing assistant message alone
    # opens a new turn (the prompt grows by more than the message), the fields keep it open.
    partial = [*PROMPT, {"role": "assistant", "content": "The river"}]
    alone = prompt_count(vllm.url, PROMPT, add_generation_prompt=True)
    assert prompt_count(vllm.url, partial) > prompt_count(vllm.url, partial, **FINAL) > alone


def test_a_vllm_stream_reads_through_the_proxy_as_vllm_wrote_it(start_proxy, vllm) -> None:
    """With no handoff, the client reads the stream vLLM wrote for its request: its head
    line by line as uvicorn writes it (lowercase names, its framing where it puts it) and
    its events, one by one. What vLLM sent is caught on its way to the proxy by a TCP relay
    (tests/tap.py), so that vLLM's own chunking, which merges tokens when its API server
    falls behind, is compared with itself; no health check crosses the relay meanwhile."""
    body = json.dumps(
        {"model": SERVED_NAME, "messages": PROMPT, "max_tokens": 12, "temperature": 0,
         "stream": True}
    ).encode()  # fmt: skip
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    with tapped(vllm.port) as tap:
        proxy = start_proxy(tap.url, [], options=["spillover_health_s=0"])
        proxy.servers_known()
        tap.arm(lambda seen: False, lambda: None)  # keeps what vLLM sends from here
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=120) as sock:
            sock.sendall(request)
            answer = b""
            while not answer.endswith(b"\r\n0\r\n\r\n") and (data := sock.recv(65536)):
                answer += data
        # The proxy ends the answer at [DONE] and drops its leg; vLLM's last chunk (its
        # body's end) may reach the relay a moment after the client's end.
        deadline = time.monotonic() + 10
        while not tap.seen.endswith(b"\r\n0\r\n\r\n") and time.monotonic() < deadline:
            time.sleep(0.02)
        sent = tap.seen
    assert sent.count(b"HTTP/1.1 ") == 1, sent[:300]  # the answer, and nothing else
    heads, streams = [], []
    for response in (sent, answer):
        head, _, rest = response.partition(b"\r\n\r\n")
        heads.append(head.split(b"\r\n"))
        streams.append(_events(rest))
    assert b"transfer-encoding: chunked" in heads[0], heads[0]
    assert heads[1] == heads[0]
    assert streams[1] == streams[0] and streams[0][-1] == b"[DONE]"


def _events(chunked: bytes) -> list[bytes]:
    """The SSE events of a chunked body."""
    body = ChunkedBody()
    data = body.feed(chunked)
    assert body.complete
    return [e[6:] for e in data.split(b"\n\n") if e.startswith(b"data: ")]


def test_a_killed_llama_server_is_continued_by_vllm(
    start_server, start_proxy, vllm: VllmServer
) -> None:
    """The official client asks for any model name; vLLM is asked in its own."""
    primary = start_server("primary")
    proxy = start_proxy(primary.url, [vllm.url])
    proxy.servers_known()
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="none")
    chunks = client.chat.completions.create(
        model="big-model", messages=PROMPT, max_tokens=LONG, temperature=0, stream=True,
        extra_body={"cache_prompt": False},
    )  # fmt: skip
    text = ""
    for n, chunk in enumerate(chunks, 1):
        text += "".join(choice.delta.content or "" for choice in chunk.choices)
        if n == 40:
            primary.kill()
    (handoff,) = httpx.get(f"{proxy.url}/spillover/status").json()["recent_handoffs"]
    assert handoff["target"] == vllm.url
    before, after = text[: handoff["at_char"]], text[handoff["at_char"] :]
    assert after == vllm_continuation(vllm.url, before, LONG - handoff["at_token"])


def test_a_stalled_llama_server_is_continued_by_vllm(
    start_server, start_proxy, vllm: VllmServer
) -> None:
    primary = start_server("primary")
    options = ["spillover_stall_s=1", "spillover_first_token_s=2"]
    proxy = start_proxy(primary.url, [vllm.url], options=options)
    proxy.servers_known()
    try:
        stream = read_stream(
            proxy.url, chat_body(LONG, model="any"),
            on_chunk=lambda n: n == 40 and os.kill(primary.pid, signal.SIGSTOP),
        )  # fmt: skip
    finally:
        os.kill(primary.pid, signal.SIGCONT)
    assert_continued_by_vllm(stream, primary, vllm, "nothing for 1.")


def test_pressure_on_the_primarys_card_moves_the_answer_to_vllm(
    start_server, start_proxy, vllm: VllmServer, tmp_path: Path
) -> None:
    primary = start_server("primary")
    sysfs = tmp_path / "sys"
    card0 = FakeCard(sysfs, "card0", total_mib=16384, used_mib=10000)
    FakeCard(sysfs, "card1", total_mib=8192, used_mib=2000)
    options = watch_sysfs(sysfs, {primary.url: "drm:card0", vllm.url: "drm:card1"})
    proxy = start_proxy(primary.url, [vllm.url], options=options)
    proxy.servers_known()
    stream = read_stream(
        proxy.url,
        chat_body(LONG, model="any"),
        on_chunk=lambda n: n == 40 and card0.set_used(16000),
    )
    assert_continued_by_vllm(stream, primary, vllm, "memory pressure on drm:card0")


def assert_continued_by_vllm(stream, primary: LlamaServer, vllm: VllmServer, why: str) -> None:
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert f"{primary.url} -> {vllm.url}" in note and why in note, note
    before, after = stream.segments
    assert after == vllm_continuation(vllm.url, before, LONG - stream.segment_tokens[0])


def test_the_clients_echo_is_not_carried_into_a_continuation(
    start_server, start_proxy, vllm: VllmServer
) -> None:
    """`echo: true` has vLLM repeat the last message when it is the assistant's: on a
    continuation that is the answer so far, which the client would read twice."""
    primary = start_server("primary")
    proxy = start_proxy(primary.url, [vllm.url])
    proxy.servers_known()
    stream = read_stream(
        proxy.url, chat_body(LONG, model="any", echo=True),
        on_chunk=lambda n: n == 40 and primary.kill(),
    )  # fmt: skip
    assert_continued_by_vllm(stream, primary, vllm, "connection")


def test_a_structured_answer_is_never_moved_mid_answer(
    start_proxy, vllm: VllmServer, fallback: LlamaServer
) -> None:
    """vLLM's own structured_outputs field binds the answer to a pattern: a handoff asked
    mid-answer is declined (the next server would start the pattern over), and the
    answer ends whole on vLLM, matching it."""
    proxy = start_proxy(vllm.url, [fallback.url])
    proxy.servers_known()
    pattern = "(the|river|bridge|stone)( (the|river|bridge|stone)){60}"
    body = chat_body(LONG, model=SERVED_NAME, structured_outputs={"regex": pattern})
    asked: list[int] = []

    def ask(n: int) -> None:
        if n == 10:
            asked.append(httpx.post(f"{proxy.url}/spillover/handoff").status_code)

    stream = read_stream(proxy.url, body, on_chunk=ask)
    assert asked and stream.notes == []
    assert_one_clean_stream(stream)
    assert re.fullmatch(pattern, stream.text.strip()), stream.text


def test_a_messages_answer_is_not_continued_where_only_chat_can_ask(
    start_server, start_proxy, vllm: VllmServer
) -> None:
    """continue_final_message is a chat field: a Messages request does not carry it, so an
    Anthropic-style answer that sent text ends with an error that says so."""
    primary = start_server("primary")
    proxy = start_proxy(primary.url, [vllm.url])
    proxy.servers_known()
    body = {"model": "any", "max_tokens": LONG, "messages": PROMPT, "stream": True,
            "temperature": 0}  # fmt: skip
    events: list[str] = []
    with httpx.stream("POST", f"{proxy.url}/v1/messages", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            events.append(line)
            if sum(1 for e in events if "text_delta" in e) == 20:
                primary.kill()
    error = next(e for e in events if e.startswith("data:") and '"error"' in e)
    assert "continues chat answers only, by continue_final_message" in error
    assert sum(1 for e in events if "text_delta" in e) >= 20  # delivered stays delivered


def test_a_reasoning_answer_is_not_continued_by_a_way_proven_on_plain_answers(
    models: dict[str, Path], server_logs: Path, start_server, start_proxy, vllm: VllmServer
) -> None:
    """A llama-server primary with the reasoning template thinks aloud (the tiny model
    never closes its reasoning) and is killed: vLLM (continue_final_message) and
    llama-cpp-python (a rendered prompt) were proven on plain answers only, so the answer
    ends with an error that says so for each, after the reasoning already delivered."""
    template = str(reasoning_template(models["primary"].parent))
    primary = start_server("primary", extra_args=["--chat-template-file", template])
    rendering = LlamaCppPythonServer(models["fallback"], log_dir=server_logs).start(timeout=120)
    try:
        proxy = start_proxy(primary.url, [vllm.url, rendering.url])
        known = proxy.servers_known()
        assert known[rendering.url]["continues_by"] == "a rendered prompt on /v1/completions"
        kill = lambda n: n == 20 and primary.kill()  # noqa: E731
        stream = read_stream(proxy.url, chat_body(LONG), on_chunk=kill)
    finally:
        rendering.stop()
    assert stream.done == 0 and stream.thoughts[0] and not stream.segments[0]
    # Each server passed by is told in-band: vLLM's refusal is why the answer moved on to
    # llama-cpp-python (a note), whose own refusal ends it (the error).
    said = "seen to go on with plain answers only"
    assert any(f"{vllm.url} continues by continue_final_message, {said}" in n for n in stream.notes)
    message = stream.errors[0]["error"]["message"]
    assert message.startswith("no server could continue this answer")
    assert f"{rendering.url} continues by a rendered prompt on /v1/completions, {said}" in message


@dataclass(frozen=True)
class Address:
    url: str


@pytest.fixture(scope="module")
def vllm_twin(vllm: VllmServer, server_logs: Path) -> Iterator[Address]:
    """The module's vLLM under another address (HAProxy, every route let through; the
    addon refuses the same address, or localhost for it, as a fallback): to the addon a
    second vLLM server with the same tokenizer, so ids move between them. (A second
    process would run the same weights the same way, and take minutes to start here.)"""
    relay = Relay(vllm.url, log_dir=server_logs, every_route=True).start()
    yield Address(relay.url)
    relay.stop()


def test_between_two_vllms_an_answer_goes_on_from_its_token_ids(
    start_proxy, vllm: VllmServer, vllm_twin: Address
) -> None:
    """The first leg is asked for its ids (return_token_ids), which the client never sees;
    the twin goes on from its own ids of the prompt and the answer's, exactly as it goes
    on when asked directly."""
    proxy = start_proxy(vllm.url, [vllm_twin.url])
    known = proxy.servers_known()
    assert (
        known[vllm.url]["tokenizer"]
        and known[vllm.url]["tokenizer"] == known[vllm_twin.url]["tokenizer"]
    )
    stream = handed_off_after_20(proxy.url)
    (note,) = stream.notes
    assert f"{vllm.url} -> {vllm_twin.url}" in note and "replayed as token ids" in note
    assert not any("token_ids" in chunk for chunk in stream.chunks)
    assert not any("token_ids" in choice for c in stream.chunks for choice in c["choices"])
    (handoff,) = httpx.get(f"{proxy.url}/spillover/status").json()["recent_handoffs"]
    assert_twin_goes_on(stream, vllm, vllm_twin, handoff["at_token"])


def handed_off_after_20(url: str) -> RawStream:
    """A LONG answer through the proxy at `url`, a handoff asked after its 20th chunk."""
    stream = read_stream(
        url, chat_body(LONG, model=SERVED_NAME),
        on_chunk=lambda n: n == 20 and httpx.post(f"{url}/spillover/handoff"),
    )  # fmt: skip
    assert_one_clean_stream(stream)
    return stream


def assert_twin_goes_on(stream: RawStream, vllm: VllmServer, twin: Address, cut: int) -> None:
    """vLLM's own answer, with its ids, asked directly: the part before the cut is the
    first leg's, and the twin, given the prompt's ids and the first `cut` ids (those
    delivered: a chunk may carry more than one), goes on as the client read it."""
    before, after = stream.segments
    whole = httpx.post(
        f"{vllm.url}/v1/chat/completions",
        json={**chat_body(LONG, model=SERVED_NAME), "stream": False, "return_token_ids": True},
        timeout=120,
    ).json()  # fmt: skip
    prompt, ids = whole["prompt_token_ids"], whole["choices"][0]["token_ids"]
    assert whole["choices"][0]["message"]["content"].startswith(before)
    direct = httpx.post(
        f"{twin.url}/v1/completions",
        json={"model": SERVED_NAME, "prompt": prompt + ids[:cut], "max_tokens": LONG - cut,
              "temperature": 0},
        timeout=120,
    ).json()["choices"][0]["text"]  # fmt: skip
    assert after == direct


def test_workers_behind_haproxy_carry_a_vllm_answer_and_its_handoff(
    vllm: VllmServer, vllm_twin: Address, server_logs: Path
) -> None:
    """`spillover run --workers 2` in front of vLLM: the handoff asked through HAProxy
    reaches whichever worker carries the answer, which goes on from its token ids."""
    if (missing := haproxy_missing()) is not None:
        pytest.skip(missing)
    pool = SpilloverWorkers(vllm.url, [vllm_twin.url], log_dir=server_logs).start()
    try:
        pool.servers_known()
        stream = handed_off_after_20(pool.url)
        (note,) = stream.notes
        assert "replayed as token ids" in note
        status = httpx.get(f"{pool.url}/spillover/status").json()
        (cut,) = [h for s in [status, *status["other_workers"]] for h in s["recent_handoffs"]]
        assert_twin_goes_on(stream, vllm, vllm_twin, cut["at_token"])
    finally:
        pool.stop()


def test_a_client_without_a_limit_gets_the_rest_with_its_usage_and_logprobs(
    start_proxy, vllm: VllmServer, vllm_twin: Address
) -> None:
    """No `max_tokens`: the continuation by ids (a text completion, whose default is 16
    tokens) is asked for the rest of the context, as the chat route's default is. The
    client's `include_usage` and `top_logprobs` keep their shape after the cut."""
    proxy = start_proxy(vllm.url, [vllm_twin.url])
    proxy.servers_known()
    body = {
        **chat_body(LONG, model=SERVED_NAME), "logprobs": True, "top_logprobs": 2,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    del body["max_tokens"]
    stream = read_stream(
        proxy.url, body, timeout=300,
        on_chunk=lambda n: n == 20 and httpx.post(f"{proxy.url}/spillover/handoff"),
    )  # fmt: skip
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert "replayed as token ids" in note
    before, after = stream.segments
    asked = {
        k: v for k, v in body.items() if k not in ("stream_options", "logprobs", "top_logprobs")
    }
    whole = httpx.post(
        f"{vllm.url}/v1/chat/completions",
        json={**asked, "stream": False, "return_token_ids": True}, timeout=300,
    ).json()  # fmt: skip
    prompt, ids = whole["prompt_token_ids"], whole["choices"][0]["token_ids"]
    assert whole["choices"][0]["message"]["content"].startswith(before)
    (handoff,) = httpx.get(f"{proxy.url}/spillover/status").json()["recent_handoffs"]
    cut = handoff["at_token"]
    # The rest of the context, named: vLLM's text route reads a null max_tokens as 16.
    context = httpx.get(f"{vllm.url}/v1/models").json()["data"][0]["max_model_len"]
    direct = httpx.post(
        f"{vllm_twin.url}/v1/completions",
        json={"model": SERVED_NAME, "prompt": prompt + ids[:cut],
              "max_tokens": context - len(prompt) - cut, "temperature": 0},
        timeout=300,
    ).json()  # fmt: skip
    assert direct["usage"]["completion_tokens"] > 16
    assert after == direct["choices"][0]["text"]
    (usage,) = [c["usage"] for c in stream.chunks if c.get("usage")]
    assert usage["completion_tokens"] == cut + direct["usage"]["completion_tokens"]
    said = [ch for c in stream.chunks for ch in c["choices"] if ch["delta"].get("content")]
    for choice in said:
        for entry in choice["logprobs"]["content"]:
            alternatives = [alt["logprob"] for alt in entry["top_logprobs"]]
            assert len(alternatives) == 2 and alternatives == sorted(alternatives, reverse=True)
            assert entry["logprob"] <= 0 and bytes(entry["bytes"]) == entry["token"].encode()


def test_an_answer_is_never_handed_back_to_a_primary_not_proven_to_continue(
    start_server, start_proxy, vllm: VllmServer, tmp_path: Path
) -> None:
    """A vLLM primary is asked nothing that generates, so it is never proven to continue
    an answer. Moved away by pressure, the answer stays on llama-server when vLLM's card
    is clear again, hand-back on: back on vLLM's chat route a trailing assistant message
    would open a new turn, read by the client as the rest of the old one."""
    fallback = start_server("fallback", ctx_size=16384, slots=2)
    sysfs = tmp_path / "sys"
    card0 = FakeCard(sysfs, "card0", total_mib=16384, used_mib=10000)
    FakeCard(sysfs, "card1", total_mib=8192, used_mib=2000)
    options = [
        *watch_sysfs(sysfs, {vllm.url: "drm:card0", fallback.url: "drm:card1"}),
        "spillover_hand_back=true", "spillover_dwell_s=0", "spillover_hand_back_min_tokens=1",
    ]  # fmt: skip
    proxy = start_proxy(vllm.url, [fallback.url], options=options)
    assert proxy.servers_known()[vllm.url]["continues"] is not True
    stayed: list[bool] = []

    def steps(n: int) -> None:
        if n != 10:
            return
        card0.set_used(15900)
        assert live_on(proxy, fallback.url)
        with held(fallback):  # live there, its primary clear, for the hand-back ticks
            card0.set_used(10000)
            stayed.append(not live_on(proxy, vllm.url, timeout=1.5))

    stream = read_stream(proxy.url, chat_body(LONG, model=SERVED_NAME), on_chunk=steps)
    assert stayed == [True]
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert f"{vllm.url} -> {fallback.url}" in note and "memory pressure" in note


@pytest.fixture(scope="module")
def vllm_turns(models: dict[str, Path], server_logs: Path) -> Iterator[VllmServer]:
    """vLLM on the HF copy of the turns family's model: another vocabulary, and a
    template that writes BOS itself and trims each message."""
    server = VllmServer(hf_copy(models["turns-fallback"]), log_dir=server_logs)
    server.start(timeout=300)
    yield server
    server.stop()


def test_vllm_of_another_family_is_proven_and_continues_a_cut_answer(
    start_server, start_proxy, vllm: VllmServer, vllm_turns: VllmServer
) -> None:
    """The proof holds for a template it was not written for, and finds what that
    template does to an answer's trailing whitespace (the chatml one keeps it)."""
    primary = start_server("primary")
    proxy = start_proxy(primary.url, [vllm_turns.url, vllm.url])
    known = proxy.servers_known()
    turns = known[vllm_turns.url]
    assert turns["continues"] is True and turns["continues_by"] == "continue_final_message"
    assert (
        turns["trims_whitespace"] is True and "drops an answer's trailing" in turns["continues_why"]
    )
    assert known[vllm.url]["trims_whitespace"] is False
    assert turns["tokenizer"] != known[vllm.url]["tokenizer"]
    stream = read_stream(
        proxy.url, chat_body(LONG, model="any"), on_chunk=lambda n: n == 40 and primary.kill()
    )
    assert_continued_by_vllm(stream, primary, vllm_turns, "connection")


def test_an_answer_ending_in_whitespace_passes_a_server_whose_template_trims_it(
    start_proxy, vllm: VllmServer, vllm_turns: VllmServer
) -> None:
    """Cut right after "\n\n" (a scripted primary: no real server stops there on
    demand). The trimming vLLM would read the answer without it and write it again; the
    answer goes on on the vLLM whose template keeps it, or, with no such server, ends
    with an error that says why."""
    said = [sse_chunk(role=True), sse_chunk("The river"), sse_chunk(" bridge"), sse_chunk("\n\n")]
    script = [(STREAM_HEAD + chunked(*said), 0.2)]
    primary = FakeUpstream(script)
    proxy = start_proxy(primary.url, [vllm_turns.url, vllm.url])
    proxy.servers_known()
    stream = read_stream(proxy.url, chat_body(LONG, model="any"))
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert f"-> {vllm.url}" in note
    before, after = stream.segments
    assert before == "The river bridge\n\n"
    assert after == vllm_continuation(vllm.url, before, LONG - 3)

    alone = FakeUpstream(script)
    proxy = start_proxy(alone.url, [vllm_turns.url])
    proxy.servers_known()
    stream = read_stream(proxy.url, chat_body(LONG, model="any"))
    message = stream.errors[0]["error"]["message"]
    assert "drops the trailing whitespace the answer so far ends with" in message
    assert stream.text == "The river bridge\n\n"
    primary.close()
    alone.close()


def test_text_that_spells_a_special_token_of_a_vllm_fallback_is_not_sent_as_text(
    start_proxy, vllm: VllmServer
) -> None:
    """vLLM's `/tokenize` reads every added token of its tokenizer in a text, and has no
    switch: its added tokens are asked of its `/tokenizer_info` instead, and a text that
    holds one (`<|im_end|>` from a scripted primary that dies after it: no real model
    here writes it as ordinary pieces on demand) does not go there; plain words go on."""
    spelled_then_plain(start_proxy, vllm.url, chat_body(20, model="any"), "spells '<|im_end|>'")


def test_an_answer_that_begins_as_its_prefill_did_goes_on_from_every_character_on_vllm(
    vllm: VllmServer,
) -> None:
    """vLLM sends a prefill back only where asked `echo`: an answer that begins with the
    client's prefilled newline goes on from every character of it (a guess from the text
    took the first for an echo, and the check agreed with a prompt one newline short)."""
    answer = "\n\nThe river runs north"
    messages = [*PROMPT, {"role": "assistant", "content": "\n"}]
    body = {"model": SERVED_NAME, "messages": messages, **FINAL, "max_tokens": 40,
            "stream": True}  # fmt: skip
    read, truth = asyncio.run(_prefill_continued(vllm, body, answer))
    assert read == truth, (read[-30:], truth[-30:])


def test_a_vllm_answer_that_begins_as_its_prefill_did_goes_on_on_llama_server(
    start_server, vllm: VllmServer
) -> None:
    """The same answer written by vLLM and continued by a llama-server: the prompt it
    reads is its rendering of the request as sent, then every newline of the answer."""
    fallback = start_server("fallback")
    answer = "\n\nThe river runs north"
    messages = [*PROMPT, {"role": "assistant", "content": "\n"}]
    body = {"messages": messages, **FINAL, "max_tokens": 40, "stream": True}

    async def continued() -> dict:
        servers = ServerDirectory()
        try:
            first = await servers.probe(Upstream(vllm.url), True)
            await servers.probe(Upstream(fallback.url), True)
            record = Transcript()
            record.begin_leg(vllm.url, echoes=prefill_echoed(body, first))
            for text in (answer[:5], answer[5:]):
                record.record({"choices": [{"index": 0, "delta": {"content": text}}]})
            leg = NextLeg("/v1/chat/completions", Chat("messages"), body, record, servers, False)
            _, sent, _, _ = await leg.continuation(Upstream(fallback.url))
            return sent
        finally:
            await servers.close()

    sent = asyncio.run(continued())
    asked = {k: v for k, v in sent.items() if k in CHAT_RENDERING}
    read = httpx.post(f"{fallback.url}/apply-template", json=asked).json()["prompt"]
    saw = {k: v for k, v in body.items() if k in CHAT_RENDERING}
    truth = httpx.post(f"{fallback.url}/apply-template", json=saw).json()["prompt"] + answer
    assert read == truth, (read[-30:], truth[-30:])


async def _prefill_continued(vllm: VllmServer, body: dict, answer: str) -> tuple[str, str]:
    """The text of the prompt vLLM reads for the continuation the addon builds of
    `answer` (vLLM's own first leg, as the splice records it), and the truth: its
    rendering of the request as sent, then the answer."""
    path, sent = await built_continuation(vllm.url, body, answer)
    async with httpx.AsyncClient(base_url=vllm.url, timeout=60) as client:

        async def text(ids: list[int]) -> str:
            said = await client.post("/detokenize", json={"model": SERVED_NAME, "tokens": ids})
            return said.json()["prompt"]

        rendering = {k: v for k, v in body.items() if k in CHAT_RENDERING or k == "model"}
        saw = (await client.post("/tokenize", json=rendering)).json()["tokens"]
        if path == "/v1/completions":
            read = sent["prompt"]
        else:
            request = {k: v for k, v in sent.items() if k in CHAT_RENDERING or k == "model"}
            read = (await client.post("/tokenize", json=request)).json()["tokens"]
        return await text(read), await text(saw) + answer


def test_a_prompt_too_long_for_vllm_goes_to_a_server_with_more_room(
    start_server, start_proxy, vllm: VllmServer
) -> None:
    """vLLM refuses a prompt longer than its max_model_len (400, in its own words): the
    request goes to a llama-server with a larger context, as the client sent it."""
    roomy = start_server("fallback", ctx_size=16384, slots=1)
    question = [{"role": "user", "content": " ".join(["the river and the bridge"] * 1000)}]
    body = chat_body(20, model=SERVED_NAME, messages=question)
    direct = httpx.post(f"{vllm.url}/v1/chat/completions", json={**body, "stream": False})
    assert direct.status_code == 400 and "maximum context length" in direct.text
    proxy = start_proxy(vllm.url, [roomy.url])
    proxy.servers_known()
    stream = read_stream(proxy.url, body)
    assert_one_clean_stream(stream)
    assert f"HTTP 400 from {vllm.url}: the prompt does not fit its context" in stream.notes[0]
    assert stream.text == direct_text(roomy.url, 20, messages=question)


def test_every_real_template_on_vllm_continues_what_the_model_saw_or_refuses(
    vllm: VllmServer, capsys
) -> None:
    """Every template llama.cpp ships, rendered by vLLM itself (named in each request,
    which this server trusts), as the next server of a cut answer over the shapes real
    clients send (the answer's raw output known: its leading space, which the primary's
    parser trimmed, is in it). The truth is vLLM's own tokens of the ORIGINAL request
    followed by what the model wrote: what the server reads of the continuation the addon
    builds (its tokens of the chat request sent, or the ids of the text completion sent)
    must decode to the truth's text, or the answer is refused with a reason. The start-up
    proof was made with the server's own template: for the others only the check at the
    moment of use stands between an answer and a wrong prompt."""
    tally, wrong = asyncio.run(_every_template_on_vllm(vllm.url))
    with capsys.disabled():
        print("\nreal templates on vLLM:", json.dumps(dict(sorted(tally.items())), indent=1))
    assert not wrong, "\n".join(wrong)
    assert tally["exact by a trailing message"] and tally["exact by a text completion"]


def test_without_the_check_vllm_continues_these_templates_wrongly(
    vllm: VllmServer, monkeypatch
) -> None:
    """The comparison is what keeps the cases above right: with it turned off (every
    trailing message taken as reading the truth), Qwen3's template (which opens an empty
    reasoning block the model never wrote before a continued message) and the turns
    family's (which trims the message) continue from prompts the model never saw."""
    monkeypatch.setattr(VllmTerms, "parting", lambda self, read, truth: None)
    names = ["Qwen-Qwen3-0.6B", "microsoft-Phi-3.5-mini-instruct"]
    _, wrong = asyncio.run(_every_template_on_vllm(vllm.url, names))
    assert any(line.startswith("Qwen-Qwen3-0.6B / plain:") for line in wrong), wrong


async def _every_template_on_vllm(
    url: str, names: list[str] | None = None
) -> tuple[Counter[str], list[str]]:
    servers = ServerDirectory()
    upstream = Upstream(url)
    tally: Counter[str] = Counter()
    wrong: list[str] = []
    try:
        await servers.probe(upstream, True)
        asker = servers.asker
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            for path in templates():
                if names is not None and path.stem not in names:
                    continue
                source = path.read_text()
                servers.asker = _with_template(asker, source)  # type: ignore[method-assign]
                found = await asyncio.gather(
                    *(_vllm_verdict(client, servers, upstream, source, shape) for shape in SHAPES)
                )
                for shape, (outcome, detail) in zip(SHAPES, found, strict=True):
                    tally[outcome] += 1
                    if outcome == "wrong":
                        wrong.append(f"{path.stem} / {shape}: {detail}")
    finally:
        await servers.close()
    return tally, wrong


def _with_template(asker, source: str):
    """The addon's questions to the server, each chat one naming `source` as its template."""

    def bound(upstream: Upstream):
        ask = asker(upstream)

        async def asked(path: str, body):
            if isinstance(body, dict) and "messages" in body:
                body = {**body, "chat_template": source}
            return await ask(path, body)

        return asked

    return bound


async def _vllm_verdict(
    client: httpx.AsyncClient, servers: ServerDirectory, upstream: Upstream, source: str,
    shape: str,
) -> tuple[str, str]:  # fmt: skip
    body = {**SHAPES[shape], "model": SERVED_NAME, "max_tokens": 40, "stream": True}
    rendering = {k: v for k, v in body.items() if k in CHAT_RENDERING or k == "model"}
    original = await client.post(
        "/tokenize", json={**rendering, "add_generation_prompt": True, "chat_template": source}
    )
    wrote = seen.written(transcript(upstream.url, exact=True), "")
    leg = NextLeg("/v1/chat/completions", Chat("messages"), body,
                  transcript(upstream.url, exact=True), servers, asks_ids=False)  # fmt: skip
    try:
        path, sent, _, _ = await leg.continuation(upstream)
    except CannotContinue as why:
        return "refused", str(why)
    if original.status_code != 200:
        return "wrong", f"continued though vLLM does not render the request: {sent}"

    async def text(ids: list[int]) -> str:
        answer = await client.post("/detokenize", json={"model": SERVED_NAME, "tokens": ids})
        return answer.json()["prompt"]

    truth = await text(original.json()["tokens"]) + wrote.text
    if path == "/v1/completions":
        read, way = sent["prompt"], "exact by a text completion"
    else:
        request = {k: v for k, v in sent.items() if k in CHAT_RENDERING or k == "model"}
        asked = await client.post("/tokenize", json={**request, "chat_template": source})
        read, way = asked.json()["tokens"], "exact by a trailing message"
    if (said := await text(read)) != truth:
        return "wrong", seen.parting(said, truth) or ""
    return way, ""


def test_the_vllm_quick_start_runs_as_written_and_a_killed_vllm_is_continued(
    vllm: VllmServer, models: dict[str, Path], tmp_path: Path
) -> None:
    """Last in this module. docs/your-cards.md's vLLM block, run by bash: its first line
    (your models) set to the tiny fallback's HF copy and the fallback itself (the same
    weights), `vllm` vLLM's own command, `llama-server` the setup's, the rest as written.
    The module's vLLM is stopped first (two cores). vLLM is killed mid-answer; after the
    cut the client gets llama-server's own continuation of what it had."""
    script = your_models(
        doc_block("docs/your-cards.md", "## vLLM as the primary"),
        BIG=hf_copy(models["fallback"]), SMALL=models["fallback"],
    )  # fmt: skip
    commands = {"vllm": vllm_command(), "llama-server": find_binary()}
    primary, fallback = "http://127.0.0.1:8081", "http://127.0.0.1:8082"
    vllm.stop()
    with (
        quick_start_ports(),
        running_as_written(script, tmp_path, commands, vllm.environment()),
    ):
        served = wait_for_model(primary, timeout=300)
        # The proxy learns a primary that was not up when it started from its first
        # request: a short one (a long answer without streaming would look stalled).
        first = {**chat_body(4, model=served), "stream": False}
        httpx.post(f"{PROXY}/v1/chat/completions", json=first, timeout=60)
        known = wait_until_ready(primary, fallback)
        assert known[primary]["engine"] == "vllm", known
        # Throttled, as on a slow card: vLLM's compiled tiny model writes hundreds of
        # tokens in the time the client reads a few, and an answer all written has
        # nothing left to move.
        body = chat_body(QUICK_LONG, model=served)
        (api_server,) = listening_pids(8081)
        with Throttled(api_server, *descendants(api_server)):
            stream = read_stream(PROXY, body, on_chunk=lambda n: n == 3 and kill_vllm(api_server))
        assert_one_clean_stream(stream)
        status = httpx.get(f"{PROXY}/spillover/status").json()
        assert len(stream.notes) == 1, (stream.notes, status)
        (note,) = stream.notes
        assert f"{primary} -> {fallback}" in note
        before, after = stream.segments
        # vLLM's own count of what it wrote (its token ids, as the note says): a throttled
        # vLLM can send two tokens in one chunk, so the client's chunks may count fewer.
        written = int(re.search(r" after (\d+) tokens ", note).group(1))
        assert written >= stream.segment_tokens[0]
        assert before and after == continuation(fallback, before, QUICK_LONG - written)


def wait_for_model(url: str, timeout: float) -> str:
    """The name of the model `url` serves, once it serves one (or `timeout`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
            return httpx.get(f"{url}/v1/models", timeout=1).json()["data"][0]["id"]
        time.sleep(0.5)
    raise AssertionError(f"{url} served no model within {timeout:.0f}s")
