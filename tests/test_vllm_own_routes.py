"""A real vLLM (its CPU build) that thinks aloud: served with a reasoning parser
(`deepseek_r1`) and a template whose generation prompt opens `<think>`, so everything the
tiny model writes is reasoning until it writes `</think>` (asked for with a logit bias on
that token: the continuation is asked with the same bias, so it is still greedy on both
sides), and with vLLM's own routes on (`--enable-scale-out`: render, generate, derender).

vLLM streams its reasoning as `delta.reasoning`. The answer is cut mid-reasoning, or after
the reasoning closed, and goes on on a second vLLM of the same tokenizer (the same server
behind HAProxy: a second process would run the same weights the same way) from its
token ids, through vLLM's own generate and derender: what the client reads is vLLM's own
answer to the request, asked of it directly, reasoning and content apart as its parser
splits them."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import httpx
import pytest

from addon.formats.transcript import Transcript
from addon.handoff.builder import Prompt
from addon.handoff.vllm import VllmTerms
from addon.servers.prompts import NotRendered
from addon.servers.vllm_routes import ON
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.prompts import TOOLS, chat_body
from scripts.testbed.relay import Relay
from scripts.testbed.tinymodels import reasoning_template
from scripts.testbed.vllmserver import (
    SERVED_NAME,
    VllmServer,
    hf_copy,
)
from tests.streams import RawStream, assert_one_clean_stream, read_stream
from tests.test_decided_handoffs import declined
from tests.test_splice import CONTROL, handoff
from tests.throttle import Throttled
from tests.vllmhere import vllm_or_skip
from watchers.listeners import descendants, listening_pids

pytestmark = pytest.mark.timeout(420)
LONG = 300
# `</think>` made likely enough that this question's answer closes its reasoning at its
# 29th token (and writes it again now and then in its content).
CLOSES_REASONING = {
    "messages": [{"role": "user", "content": "Tell me about rivers."}],
    "logit_bias": {"1289": 17},
}


@pytest.fixture(scope="module")
def thinking_vllm(models: dict[str, Path], server_logs: Path, tmp_path_factory) -> Iterator[str]:
    vllm_or_skip()
    template = reasoning_template(tmp_path_factory.mktemp("template"))
    flags = ["--reasoning-parser", "deepseek_r1", "--chat-template", str(template),
             "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]  # fmt: skip
    server = VllmServer(
        hf_copy(models["fallback"]), max_model_len=1024, log_dir=server_logs,
        extra_args=[*flags, "--enable-scale-out"],
    ).start(timeout=300)  # fmt: skip
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def twin(thinking_vllm: str, server_logs: Path) -> Iterator[str]:
    """The same vLLM under a second address (HAProxy, every route let through)."""
    relay = Relay(thinking_vllm, log_dir=server_logs, every_route=True).start()
    yield relay.url
    relay.stop()


@pytest.fixture(scope="module")
def third(thinking_vllm: str, server_logs: Path) -> Iterator[str]:
    """The same vLLM under a third address."""
    relay = Relay(thinking_vllm, log_dir=server_logs, every_route=True).start()
    yield relay.url
    relay.stop()


def direct(url: str, body: dict) -> dict:
    """vLLM's own whole answer to `body`, asked of it directly."""
    asked = {**{k: v for k, v in body.items() if k != "stream_options"}, "stream": False}
    return httpx.post(f"{url}/v1/chat/completions", json=asked, timeout=300).json()


def cut_at(proxy_url: str, body: dict, chunk: int, slowed: str | None = None) -> RawStream:
    """The answer asked to move at the client's `chunk`th chunk (by one kept client: a new
    one costs tens of ms, while the answer runs on); `slowed`: that vLLM is throttled
    meanwhile, as on a slow card (run free on a loaded machine, the proxy may have the
    answer far past the client's chunk when the handoff lands)."""
    with Throttled(*vllm_pids(slowed), run_s=0.006) if slowed else nullcontext():
        stream = read_stream(
            proxy_url, body, timeout=300,
            on_chunk=lambda n: n == chunk and CONTROL.post(f"{proxy_url}/spillover/handoff"),
        )  # fmt: skip
    assert_one_clean_stream(stream)
    return stream


def the_note(stream: RawStream, proxy_url: str) -> str:
    """The stream's one handoff note; else a failure that says what the proxy declined."""
    assert len(stream.notes) == 1, (  # the proxy's declines, asked only on a failure
        stream.notes,
        httpx.get(f"{proxy_url}/spillover/status").json()["declined_handoffs"],
    )
    return stream.notes[0]


def vllm_pids(url: str) -> list[int]:
    """The vLLM serving `url`: its API server and the engine under it."""
    (api_server,) = listening_pids(int(url.rsplit(":", 1)[1]))
    return [api_server, *descendants(api_server)]


def test_vllm_says_it_serves_its_own_routes(start_proxy, thinking_vllm: str, twin: str) -> None:
    proxy = start_proxy(thinking_vllm, [twin])
    known = proxy.servers_known()
    assert known[twin]["own_routes"] == ON
    assert known[thinking_vllm]["own_routes"] == ON
    said = subprocess.run(
        [sys.executable, "-m", "scripts.doctor", "--servers", f"{thinking_vllm},{twin}"],
        capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    assert f"{twin}: vllm; continues an answer" in said
    assert said.count(f"vLLM's own routes: {ON}") == 2, said


def test_what_the_model_saw_is_vllms_own_render_or_refused(thinking_vllm: str) -> None:
    """With its own routes, what the model saw is its render route's ids of the request
    as sent (`documents` and all: its chat route renders them); without them, `/tokenize`
    would drop `documents`, so the continuation is refused naming it."""
    body = {**chat_body(LONG, model=SERVED_NAME), "documents": [{"title": "t", "text": "x"}]}

    async def saw(routes: bool) -> Prompt:
        async with httpx.AsyncClient(base_url=thinking_vllm, timeout=30) as client:

            async def ask(path: str, asked: dict) -> dict:
                return (await client.post(path, json=asked)).raise_for_status().json()

            terms = VllmTerms(thinking_vllm, ask, SERVED_NAME, body, Transcript(), 1024, routes)
            return await terms.saw()

    rendered = httpx.post(f"{thinking_vllm}/v1/chat/completions/render", json=body).json()
    assert asyncio.run(saw(True)).ids == tuple(rendered["token_ids"])
    with pytest.raises(NotRendered, match="does not render documents"):
        asyncio.run(saw(False))


def test_a_cut_inside_the_reasoning_goes_on_inside_it(
    start_proxy, thinking_vllm: str, twin: str
) -> None:
    """Cut while the model thinks: the twin goes on inside the same reasoning (never a
    second reasoning from a new start), and the client reads vLLM's own reasoning whole,
    in vLLM's field."""
    proxy = start_proxy(thinking_vllm, [twin])
    proxy.servers_known()
    body = chat_body(LONG, model=SERVED_NAME)
    stream = cut_at(proxy.url, body, 10)
    note = the_note(stream, proxy.url)
    assert "replayed as token ids" in note and "after 0 tokens" not in note
    assert all(stream.thoughts) and not "".join(stream.segments)
    whole = direct(thinking_vllm, body)["choices"][0]["message"]
    assert "".join(stream.thoughts) == whole["reasoning"]
    fields = {k for c in stream.chunks for ch in c["choices"] for k in ch.get("delta") or {}}
    assert "reasoning" in fields and "reasoning_content" not in fields


def test_a_continuation_cut_again_goes_on_from_its_ids_too(
    start_proxy, thinking_vllm: str, twin: str, third: str
) -> None:
    """Cut inside the reasoning, then cut again after it closed: the second leg, read
    through vLLM's derender, brought its ids too (asked of the derender, taken out
    again), so the third goes on from every id and the whole answer is vLLM's own."""
    proxy = start_proxy(thinking_vllm, [twin, third])
    proxy.servers_known()
    usage = {"stream_options": {"include_usage": True}}
    body = chat_body(LONG, model=SERVED_NAME, **CLOSES_REASONING, **usage)
    stream = read_stream(
        proxy.url, body, timeout=300,
        on_chunk=lambda n: n in (10, 40) and httpx.post(f"{proxy.url}/spillover/handoff"),
    )  # fmt: skip
    assert_one_clean_stream(stream)
    assert len(stream.notes) == 2 and all("replayed as token ids" in n for n in stream.notes)
    assert not any("token_ids" in ch for c in stream.chunks for ch in c["choices"])
    whole = direct(thinking_vllm, body)
    message = whole["choices"][0]["message"]
    reasoning, content = "".join(stream.thoughts), "".join(stream.segments)
    assert (reasoning, content) == (message["reasoning"], message["content"])
    # Usage for the whole answer, the client's own prompt as vLLM counts it.
    (counted,) = [c["usage"] for c in stream.chunks if c.get("usage")]
    assert (counted["prompt_tokens"], counted["completion_tokens"]) == (
        whole["usage"]["prompt_tokens"],
        LONG,
    )


def test_a_cut_after_the_reasoning_closed_goes_on_as_content(
    start_proxy, thinking_vllm: str, twin: str
) -> None:
    """Cut after `</think>`: the twin's parser reads the reasoning closed in its prompt and
    goes on with content; the whole answer is vLLM's own, to its last token (the budget
    counted the marker token vLLM sent as an id alone, once)."""
    proxy = start_proxy(thinking_vllm, [twin])
    proxy.servers_known()
    body = chat_body(LONG, model=SERVED_NAME, **CLOSES_REASONING)
    stream = cut_at(proxy.url, body, 40)
    note = the_note(stream, proxy.url)
    assert "replayed as token ids" in note
    before, after = stream.segments
    assert stream.thoughts[0] and before and after and not stream.thoughts[1]
    message = direct(thinking_vllm, body)["choices"][0]["message"]
    assert (stream.thoughts[0], before + after) == (message["reasoning"], message["content"])


def test_with_tools_offered_a_cut_goes_on_exactly(
    start_proxy, thinking_vllm: str, twin: str
) -> None:
    """Tools offered (its hermes tool-call parser reads the answer; the tiny model calls
    none): the twin goes on from the ids, read by the same parsers, as vLLM answers."""
    proxy = start_proxy(thinking_vllm, [twin])
    proxy.servers_known()
    body = chat_body(LONG, model=SERVED_NAME, tools=TOOLS, **CLOSES_REASONING)
    stream = cut_at(proxy.url, body, 40)
    note = the_note(stream, proxy.url)
    assert "replayed as token ids" in note
    before, after = stream.segments
    message = direct(thinking_vllm, body)["choices"][0]["message"]
    assert (stream.thoughts[0], before + after) == (message["reasoning"], message["content"])


def test_what_vllms_parsers_showed_is_not_continued_as_what_the_model_wrote(
    start_proxy, thinking_vllm: str, fallback: LlamaServer
) -> None:
    """A llama-server does not read vLLM's ids: the reasoning the client got is what
    vLLM's parser showed (its markers hidden), so an asked handoff is declined before the
    cut (issue 53) and the answer comes whole from vLLM; the status says why."""
    proxy = start_proxy(thinking_vllm, [fallback.url])
    proxy.servers_known()
    asked: list[int] = []
    stream = read_stream(
        proxy.url, chat_body(LONG, model=SERVED_NAME), timeout=300,
        on_chunk=lambda n: n == 10 and asked.append(handoff(proxy)),
    )  # fmt: skip
    assert asked == [0]
    assert_one_clean_stream(stream)
    assert stream.thoughts[0] and stream.notes == [] and stream.done == 1
    (entry,) = declined(proxy)["recent"]
    assert entry["kind"] == "requested" and entry["server"] == thinking_vllm, entry
    assert "known only as vLLM's reasoning parser showed it" in entry["why"], entry


def test_a_killed_llama_server_goes_on_inside_its_reasoning_on_vllm(
    models: dict[str, Path], start_server, start_proxy, thinking_vllm: str
) -> None:
    """A llama-server primary with the same template thinks aloud and is killed: what its
    model wrote is known byte for byte (each token's bytes), vLLM renders the original
    request itself and generates from its ids of that text, and its parser reads the
    reasoning still open: the client's reasoning goes on, in the field it was reading,
    exactly as vLLM's own text completion of the same prompt goes on."""
    template = str(reasoning_template(models["primary"].parent))
    primary = start_server("primary", extra_args=["--chat-template-file", template])
    proxy = start_proxy(primary.url, [thinking_vllm])
    proxy.servers_known()
    body = chat_body(LONG)
    stream = read_stream(proxy.url, body, on_chunk=lambda n: n == 20 and primary.kill())
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert f"-> {thinking_vllm}" in note
    before, after = stream.thoughts
    assert before and after and not "".join(stream.segments)
    fields = {k for c in stream.chunks for ch in c["choices"] for k in ch.get("delta") or {}}
    assert "reasoning_content" in fields and "reasoning" not in fields
    (handoff,) = httpx.get(f"{proxy.url}/spillover/status").json()["recent_handoffs"]
    named = {**body, "model": SERVED_NAME}
    saw = httpx.post(f"{thinking_vllm}/v1/chat/completions/render", json=named).json()
    truth = saw["token_ids"] + tokens(thinking_vllm, before)
    asked = {"model": SERVED_NAME, "prompt": truth, "temperature": 0,
             "max_tokens": LONG - handoff["at_token"]}  # fmt: skip
    own = httpx.post(f"{thinking_vllm}/v1/completions", json=asked, timeout=300).json()
    assert after == own["choices"][0]["text"]


def tokens(url: str, text: str) -> list[int]:
    asked = {"model": SERVED_NAME, "prompt": text, "add_special_tokens": False}
    return httpx.post(f"{url}/tokenize", json=asked).json()["tokens"]


def test_a_client_that_asked_for_ids_gets_them_after_the_cut(
    start_proxy, thinking_vllm: str, twin: str
) -> None:
    """`return_token_ids` from the client: the twin's derendered chunks carry its
    generated ids too, and they are vLLM's own ids of the whole answer."""
    proxy = start_proxy(thinking_vllm, [twin])
    proxy.servers_known()
    body = chat_body(LONG, model=SERVED_NAME, return_token_ids=True)
    stream = cut_at(proxy.url, body, 10)
    assert "replayed as token ids" in the_note(stream, proxy.url)
    ids = [i for c in stream.chunks for ch in c["choices"] for i in ch.get("token_ids") or ()]
    assert ids == direct(thinking_vllm, body)["choices"][0]["token_ids"]


def test_llama_cpps_own_sampling_is_not_carried_to_vllm(
    start_server, start_proxy, thinking_vllm: str
) -> None:
    """A llama-server primary sampled under repeat_penalty, which vLLM does not have:
    the answer is not continued there, in-band saying why."""
    primary = start_server("primary")
    proxy = start_proxy(primary.url, [thinking_vllm])
    proxy.servers_known()
    body = chat_body(LONG, repeat_penalty=1.3)
    stream = read_stream(proxy.url, body, on_chunk=lambda n: n == 20 and primary.kill())
    assert stream.segments[0] and stream.done == 0
    assert "vLLM has no repeat_penalty" in stream.errors[0]["error"]["message"]


def test_a_penalty_vllm_would_start_over_is_not_carried(
    start_proxy, thinking_vllm: str, twin: str
) -> None:
    """vLLM counts presence_penalty over the tokens it generated itself: a continuation
    would start it over, so the handoff is declined before the cut, saying so, and the
    answer stays whole on the first vLLM."""
    proxy = start_proxy(thinking_vllm, [twin])
    proxy.servers_known()
    body = chat_body(LONG, model=SERVED_NAME, presence_penalty=0.5)
    stream = read_stream(
        proxy.url, body, timeout=300,
        on_chunk=lambda n: n == 10 and httpx.post(f"{proxy.url}/spillover/handoff"),
    )  # fmt: skip
    assert_one_clean_stream(stream)
    assert stream.notes == [], "it stayed"
    (said,) = declined(proxy)["recent"]
    assert "presence_penalty would start over" in str(said)


# A tool whose one argument is an enum: `tool_choice: "required"` (a JSON schema vLLM
# decodes to once the reasoning closes) makes the tiny model write a real call.
FORCED_CALL = {
    "tool_choice": "required",
    "tools": [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                       "required": ["city"]},
    }}],
}  # fmt: skip


def test_a_call_written_after_the_cut_comes_as_vllms_own_tool_calls(
    start_proxy, thinking_vllm: str, twin: str
) -> None:
    """Cut in the reasoning, a call required: the twin goes on from the ids with the
    sampling its render resolved (the call's schema) and its own parsers, so the rest of
    the reasoning and the calls are vLLM's own streamed answer's, as `tool_calls`, and it
    ends as that answer does (vLLM's non-streamed answer gives them as content instead)."""
    proxy = start_proxy(thinking_vllm, [twin])
    proxy.servers_known()
    body = chat_body(LONG, model=SERVED_NAME, **FORCED_CALL, **CLOSES_REASONING)
    # The reasoning closes at the 29th token. Past it when the cut lands (vLLM, starved on
    # a loaded machine, merges tokens into one chunk), vLLM holds a call's text back, its
    # ids ahead of it: the move is declined there, rightly. Cuts are asked until one lands
    # in the reasoning, each decline checked.
    for attempt in range(1, CUTS + 1):
        stream = cut_at(proxy.url, body, 5, slowed=thinking_vllm)
        if stream.notes:
            break
        recent = declined(proxy)["recent"]
        assert len(recent) == attempt and "vLLM's tool-call parser" in str(recent[-1]), recent
    note = the_note(stream, proxy.url)
    assert "replayed as token ids" in note
    alone = read_stream(thinking_vllm, body, timeout=300)
    assert stream.thoughts[0] + stream.thoughts[1] == alone.thoughts[0]
    assert _calls(stream) == _calls(alone) and len(_calls(stream)) > 1 and not stream.text
    # The budget cut the last call: vLLM's chat route says `length`, and so must the
    # continuation, whose derender would say `tool_calls` (a whole call to run).
    assert stream.finishes == alone.finishes == ["length"]


CUTS = 4


def _calls(stream: RawStream) -> list[tuple[str, str]]:
    """(name, arguments) of each tool call by index, its pieces put together."""
    calls: dict[int, list[str]] = {}
    for chunk in stream.chunks:
        for choice in chunk["choices"]:
            for piece in (choice.get("delta") or {}).get("tool_calls") or ():
                function = piece.get("function") or {}
                call = calls.setdefault(piece["index"], ["", ""])
                call[0] += function.get("name") or ""
                call[1] += function.get("arguments") or ""
    return [(calls[i][0], calls[i][1]) for i in sorted(calls)]
