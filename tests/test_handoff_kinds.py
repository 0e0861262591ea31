"""Handoffs for more kinds of answer: whole (non-streaming) answers, context caps, chains
of fallbacks, characters split across reads."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from addon.answer.fleet import Fleet, Route
from addon.answer.splice import Splice
from addon.formats.carried import CHAT
from addon.servers.info import ServerInfo
from addon.servers.upstream import Upstream
from scripts.parts.processes import free_port
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.prompts import TOOLS
from scripts.testbed.scripted_upstream import (
    STREAM_HEAD,
    FakeUpstream,
    chunked,
    cut_tool_call,
    sse_chunk,
    tool_piece,
)
from tests.streams import (
    PROMPT,
    assert_one_clean_stream,
    chat_body,
    continuation,
    direct_text,
    read_stream,
)

CONTROL = httpx.Client()


def test_a_whole_answer_comes_from_the_fallback_when_the_primary_is_down(
    start_proxy, fallback: LlamaServer
) -> None:
    # Found dead by its refused connection (routing by /health is tested in test_routing.py).
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = start_proxy(dead, [fallback.url], options=["spillover_health_s=0"])
    reply = httpx.post(f"{proxy.url}/v1/chat/completions", json={**chat_body(40), "stream": False})
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["message"]["content"] == direct_text(fallback.url, 40)
    assert "-> " + fallback.url in reply.headers["x-spillover-handoff"]


def test_a_whole_answer_survives_the_primary_dying_before_it_answers(
    start_proxy, fallback: LlamaServer
) -> None:
    """Fake primary: it accepts the request, stalls, and drops the connection unanswered."""
    fake = FakeUpstream([(b"", 0.3)])
    proxy = start_proxy(fake.url, [fallback.url])
    proxy.servers_known()
    reply = httpx.post(f"{proxy.url}/v1/chat/completions", json={**chat_body(40), "stream": False})
    assert reply.json()["choices"][0]["message"]["content"] == direct_text(fallback.url, 40)
    said = reply.headers["x-spillover-handoff"]
    assert f"({fake.url} closed the connection before its response)" in said
    fake.close()


def test_a_fallback_too_small_for_the_rest_is_skipped(start_server, start_proxy) -> None:
    primary = start_server("primary")
    small = start_server("fallback", ctx_size=256, slots=1)  # 256 tokens per slot
    big = start_server("fallback")  # 1,024 per slot
    proxy = start_proxy(primary.url, [small.url, big.url])
    stream = read_stream(proxy.url, chat_body(600), on_chunk=lambda n: n == 150 and primary.kill())
    assert_one_clean_stream(stream)
    assert len(stream.notes) == 2
    assert f"{small.url} has 256 tokens per slot" in stream.notes[1]
    before, skipped, after = stream.segments
    assert skipped == ""
    assert after == continuation(big.url, before, 600 - stream.segment_tokens[0])


def test_no_fallback_with_room_ends_with_a_clear_error(start_server, start_proxy) -> None:
    primary = start_server("primary")
    small = start_server("fallback", ctx_size=256, slots=1)
    proxy = start_proxy(primary.url, [small.url])
    stream = read_stream(proxy.url, chat_body(600), on_chunk=lambda n: n == 150 and primary.kill())
    assert stream.done == 0 and stream.segment_tokens[0] >= 149
    (error,) = stream.errors
    assert "has 256 tokens per slot, the rest of this answer needs" in error["error"]["message"]


def test_a_chain_of_fallbacks_stays_one_stream(
    start_server, start_proxy, primary: LlamaServer, fallback: LlamaServer
) -> None:
    second = start_server("primary")  # the last rung: another server
    proxy = start_proxy(primary.url, [fallback.url, second.url])

    def twice(n: int) -> None:
        if n in (20, 120):
            CONTROL.post(f"{proxy.url}/spillover/handoff")

    stream = read_stream(proxy.url, chat_body(800), on_chunk=twice)
    assert_one_clean_stream(stream)
    assert [n.split(" -> ")[1].split()[0] for n in stream.notes] == [fallback.url, second.url]
    first, middle, last = stream.segments
    assert direct_text(primary.url, 800).startswith(first)
    assert (
        middle == continuation(fallback.url, first, 800 - stream.segment_tokens[0])[: len(middle)]
    )
    produced = stream.segment_tokens[0] + stream.segment_tokens[1]
    assert last == continuation(second.url, first + middle, 800 - produced)
    assert sum(stream.segment_tokens) == 800


def test_characters_split_across_reads_arrive_whole(start_proxy, fallback: LlamaServer) -> None:
    """Fake primary: byte-exact control over where the network splits a character."""
    wire = STREAM_HEAD + chunked(sse_chunk(role=True), sse_chunk(" café"), sse_chunk(" 日本"))
    cut = wire.index("日".encode()) + 1  # inside the character
    fake = FakeUpstream([
        (wire[:cut], 0.2),
        (wire[cut:] + chunked(sse_chunk(finish="stop"), b"data: [DONE]\n\n") + b"0\r\n\r\n", 0),
    ])  # fmt: skip
    proxy = start_proxy(fake.url, [fallback.url])
    proxy.servers_known()
    stream = read_stream(proxy.url, chat_body(10))
    assert_one_clean_stream(stream)
    assert stream.text == " café 日本" and stream.notes == []
    fake.close()


def test_a_cut_inside_a_character_delivers_only_whole_events(
    start_proxy, fallback: LlamaServer
) -> None:
    """Fake primary: it dies half-way through a multi-byte character's event."""
    wire = STREAM_HEAD + chunked(sse_chunk(role=True), sse_chunk(" café"), sse_chunk(" 日本"))
    cut = wire.index("日".encode()) + 1
    fake = FakeUpstream([(wire[:cut], 0.2)])
    proxy = start_proxy(fake.url, [fallback.url])
    proxy.servers_known()
    stream = read_stream(proxy.url, chat_body(10))
    assert_one_clean_stream(stream)
    assert stream.segments == [" café", continuation(fallback.url, " café", 9)]
    fake.close()


def test_several_choices_are_passed_through_unspliced(proxy, primary: LlamaServer) -> None:
    body = {"messages": PROMPT, "max_tokens": 5, "n": 2, "stream": False}
    via = httpx.post(f"{proxy.url}/v1/chat/completions", json=body)
    direct = httpx.post(f"{primary.url}/v1/chat/completions", json=body)
    assert via.status_code == direct.status_code
    assert "x-spillover-handoff" not in via.headers


def test_a_constrained_answer_is_not_continued_elsewhere(
    start_server, start_proxy, fallback: LlamaServer
) -> None:
    """A JSON-bound answer cut mid-way cannot be finished by a server that would start its
    grammar over: the client is told so in-band, and keeps what it has."""
    primary = start_server("primary")
    proxy = start_proxy(primary.url, [fallback.url])
    body = chat_body(400, response_format={"type": "json_object"})
    counts: list[int] = []

    def act(n: int) -> None:
        if n == 10:
            counts.append(CONTROL.post(f"{proxy.url}/spillover/handoff").json()["handed_off"])
        if n == 30:
            primary.kill()

    stream = read_stream(proxy.url, body, on_chunk=act)
    assert counts == [0]  # pressure: the primary carries on rather than break the promise
    assert stream.notes == [] and stream.segment_tokens[0] >= 29
    (error,) = stream.errors
    assert "bound by response_format" in error["error"]["message"]


def tool_stream(client: openai.OpenAI):
    return client.chat.completions.stream(model="any", messages=PROMPT, max_tokens=20, tools=TOOLS)


def test_tool_calls_reach_the_client_whole(start_proxy, fallback: LlamaServer) -> None:
    """Fake primary: the tiny models do not call tools."""
    fake = FakeUpstream([(
        STREAM_HEAD + chunked(
            sse_chunk(role=True), sse_chunk(" ok"), tool_piece(0, '{"a"', name="f"),
            tool_piece(0, ": 1}"), sse_chunk(finish="tool_calls"), b"data: [DONE]\n\n",
        ) + b"0\r\n\r\n", 0,
    )])  # fmt: skip
    proxy = start_proxy(fake.url, [fallback.url])
    proxy.servers_known()
    pieces = []
    with tool_stream(openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="none")) as stream:
        for event in stream:
            if event.type == "chunk" and event.chunk.choices[0].delta.tool_calls:
                pieces.append(event.chunk.choices[0].delta.tool_calls)
        final = stream.get_final_completion()
    assert len(pieces) == 1  # one delta carrying the whole call
    (call,) = final.choices[0].message.tool_calls
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "call-0",
        "f",
        {"a": 1},
    )
    assert final.choices[0].message.content == " ok"
    fake.close()


def test_a_tool_call_cut_by_a_handoff_comes_whole_from_the_fallback(start_proxy) -> None:
    """Fake primary and fallback: the primary dies inside a call's arguments."""
    primary_script, fallback_script = cut_tool_call()
    primary, fallback = FakeUpstream(primary_script), FakeUpstream(fallback_script)
    proxy = start_proxy(primary.url, [fallback.url])
    with tool_stream(openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="none")) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("g", {"a": 2})
    assert final.choices[0].message.content == " ok"
    (continued,) = [json.loads(r) for r in fallback.requests if b"Zq7" not in r and r]
    assert continued["messages"][-1] == {"role": "assistant", "content": " ok"}
    primary.close()
    fallback.close()


def test_after_a_whole_call_went_out_a_failure_is_told_clearly(
    start_proxy, fallback: LlamaServer
) -> None:
    """Fake primary: call 0 is complete (call 1 began) when it dies."""
    fake = FakeUpstream([(
        STREAM_HEAD + chunked(
            sse_chunk(role=True), tool_piece(0, "{}", name="f"), tool_piece(1, "{", name="h"),
        ), 0.2,
    )])  # fmt: skip
    proxy = start_proxy(fake.url, [fallback.url])
    proxy.servers_known()
    with (
        pytest.raises(openai.APIError, match="tool_calls, which cannot be continued"),
        tool_stream(openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="none")) as stream,
    ):
        for _ in stream:
            pass
    fake.close()


def test_a_text_completion_stream_is_spliced_exactly(
    proxy, primary: LlamaServer, fallback: LlamaServer
) -> None:
    prompt = "The river and the bridge"
    body = {"prompt": prompt, "max_tokens": 600, "temperature": 0, "stream": True,
            "cache_prompt": False, "stream_options": {"include_usage": True}}  # fmt: skip
    stream = read_stream(
        proxy.url,
        body,
        on_chunk=lambda n: n == 20 and CONTROL.post(f"{proxy.url}/spillover/handoff"),
        path="/v1/completions",
    )
    assert stream.done == 1 and len(stream.notes) == 1 and len(stream.finishes) == 1
    before, after = stream.segments
    whole = httpx.post(
        f"{primary.url}/v1/completions", json={**body, "stream": False}, timeout=60
    ).json()["choices"][0]["text"]
    assert whole.startswith(before)
    left = 600 - stream.segment_tokens[0]
    expected = httpx.post(
        f"{fallback.url}/completion",
        json={
            "prompt": prompt + before,
            "n_predict": left,
            "temperature": 0,
            "cache_prompt": False,
        },
        timeout=60,
    ).json()["content"]
    assert after == expected
    assert stream.chunks[-1]["usage"]["completion_tokens"] == 600
    assert len({c["id"] for c in stream.chunks}) == 1


def test_a_move_is_admitted_again_when_its_room_is_known() -> None:
    """The race of a move that must ask the target for room: it was admitted while no
    text had gone out (any server may answer a request from the start), the first text
    went out during the round trips, and the target is not proven to continue an
    answer. The cut is decided when the room is known, so the answer stays where it is.
    (No real server can be made to answer a room check at that moment on demand: the
    check here is a stand-in that lets the first text out while it is asked.)"""
    primary, unproven = Upstream("http://127.0.0.1:1"), Upstream("http://127.0.0.1:2")
    fleet = Fleet()
    fleet.servers.info[unproven] = ServerInfo(continues=False, continues_why="a new turn")
    body = {"messages": [{"role": "user", "content": "Hi."}], "stream": True, "max_tokens": 50}

    async def scenario() -> tuple[bool, bool]:
        splice = Splice(
            path="/v1/chat/completions", dialect=CHAT, headers=[], body=body,
            raw_body=json.dumps(body).encode(), route=Route([primary, unproven], primary),
            fleet=fleet,
        )  # fmt: skip
        leg = splice._leg_task = asyncio.ensure_future(asyncio.sleep(5))
        splice._next.fits_without_asking = lambda _: False

        async def fits(_: Upstream) -> bool:
            await asyncio.sleep(0.01)  # the room check's round trips...
            splice.transcript.begin_leg(primary.url)
            splice.transcript.add("The river")  # ...while the first text goes out
            return True

        splice._next.fits = fits
        moving = splice.handoff("asked", "requested")
        assert moving is not None  # admitted when asked: nothing had gone out
        moved = await moving
        cut = leg.cancelling() > 0 or splice._pending is not None
        leg.cancel()
        return moved, cut

    moved, cut = asyncio.run(scenario())
    assert moved is False and not cut
