"""The splice end to end: real llama-servers, a real mitmdump with the addon, real clients."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from mitmproxy import io

from addon.servers.traits import MARKER
from scripts.parts.processes import free_port
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.mitm import Mitmdump
from scripts.testbed.scripted_upstream import STREAM_HEAD, FakeUpstream, chunked, sse_chunk
from tests.streams import (
    PROMPT,
    RawStream,
    assert_exact_splice,
    assert_one_clean_stream,
    assert_splice_up_to_ties,
    chat_body,
    continuation,
    direct_text,
    read_stream,
    record,
    recorded_stream,
    solo_steps,
)

# Long enough that the tiny primary (~2,000 tokens/s) is still generating when a handoff
# asked for at a client-side chunk count lands; it fits the shared servers' 1,024-token slots.
LONG = 800


# One client for control calls: a new httpx client costs tens of ms (CA bundle), during
# which the primary would run on by a hundred tokens.
CONTROL = httpx.Client()


def handoff(proxy: Mitmdump, **args) -> int:
    return CONTROL.post(f"{proxy.url}/spillover/handoff", json=args).json()["handed_off"]


def handoff_after(proxy: Mitmdump, chunks: int, hold: LlamaServer | None = None):
    """Ask for a handoff once the client has `chunks` chunks. With `hold`, that server is
    stopped (SIGSTOP) while the handoff is asked for, so the cut lands right there even
    when a loaded machine is slow to pass the request on."""

    def on_chunk(n: int) -> None:
        if n == chunks:
            with held(hold):
                handoff(proxy, reason="test pressure")

    return on_chunk


@contextmanager
def held(server: LlamaServer | None) -> Iterator[None]:
    if server is not None:
        os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if server is not None:
            os.kill(server.pid, signal.SIGCONT)


def test_other_traffic_passes_through_untouched(proxy: Mitmdump, primary: LlamaServer) -> None:
    for path in ("/v1/models", "/props", "/health"):
        via, direct = httpx.get(proxy.url + path).json(), httpx.get(primary.url + path).json()
        if path == "/v1/models":  # llama-server stamps each model list with the current second
            for entry in via["data"] + direct["data"]:
                entry.pop("created")
        assert via == direct, path
    tokenize = {"content": "the river"}
    assert (
        httpx.post(proxy.url + "/tokenize", json=tokenize).json()
        == httpx.post(primary.url + "/tokenize", json=tokenize).json()
    )
    body = {**chat_body(40), "stream": False}
    via = httpx.post(proxy.url + "/v1/chat/completions", json=body).json()
    assert via["choices"][0]["message"]["content"] == direct_text(primary.url, 40)
    assert (
        via["model"] == httpx.post(primary.url + "/v1/chat/completions", json=body).json()["model"]
    )


def test_malformed_stream_request_gets_the_primarys_clear_error(proxy: Mitmdump) -> None:
    reply = httpx.post(
        proxy.url + "/v1/chat/completions",
        json={"messages": "not a list", "stream": True},
    )
    assert reply.status_code == 400 and "error" in reply.json()
    garbled = httpx.post(proxy.url + "/v1/chat/completions", content=b"{not json")
    assert garbled.status_code in (400, 500) and "error" in garbled.json()


def test_stream_without_handoff_is_the_primarys_stream(
    proxy: Mitmdump, primary: LlamaServer
) -> None:
    via = read_stream(proxy.url, chat_body(120))
    direct = read_stream(primary.url, chat_body(120))
    assert_one_clean_stream(via)
    assert via.notes == [] and via.text == direct.text
    assert len(via.chunks) == len(direct.chunks)
    assert {c["model"] for c in via.chunks} == {c["model"] for c in direct.chunks}


@pytest.mark.parametrize("cut", [1, 2, 40, 150])
def test_handoff_splices_the_exact_text(
    proxy: Mitmdump, primary: LlamaServer, fallback: LlamaServer, cut: int
) -> None:
    """Cut 1 lands right after the role delta, before the first token. The answer is long
    enough that the primary is still generating when the handoff lands."""
    on_chunk = handoff_after(proxy, cut, hold=primary)
    stream = read_stream(proxy.url, chat_body(LONG), on_chunk=on_chunk)
    assert_one_clean_stream(stream)
    assert len(stream.notes) == 1 and "test pressure" in stream.notes[0]
    assert_exact_splice(stream, primary.url, fallback.url, LONG)
    models = [c["model"] for c in stream.chunks]
    fallback_model = json.loads(httpx.get(fallback.url + "/props").text)["model_path"]
    assert models[-1] == fallback_model != models[0]


def test_openai_sdk_sees_one_stream_across_a_handoff(
    proxy: Mitmdump, primary: LlamaServer, fallback: LlamaServer
) -> None:
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="none")
    chunks = []
    for chunk in client.chat.completions.create(
        model="any", messages=PROMPT, max_tokens=LONG, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"cache_prompt": False},
    ):  # fmt: skip
        chunks.append(chunk)
        if len(chunks) == 30:
            handoff(proxy)
    primary_model = chunks[0].model
    before = "".join(
        c.choices[0].delta.content or "" for c in chunks if c.choices and c.model == primary_model
    )
    after = "".join(
        c.choices[0].delta.content or "" for c in chunks if c.choices and c.model != primary_model
    )
    assert before and after
    assert direct_text(primary.url, LONG).startswith(before)
    produced = sum(
        1 for c in chunks if c.choices and c.choices[0].delta.content and c.model == primary_model
    )
    assert after == continuation(fallback.url, before, LONG - produced)
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    usage = chunks[-1].usage
    assert usage.completion_tokens == LONG
    legs = usage.model_extra["spillover"]["legs"]
    assert [leg["server"] for leg in legs] == [primary.url, fallback.url]
    assert sum(leg["completion_tokens"] for leg in legs) == LONG


def test_async_sdk_streams_across_a_handoff(proxy: Mitmdump, primary: LlamaServer) -> None:
    async def run() -> tuple[str, set[str]]:
        client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="none")
        text, models, n = "", set(), 0
        stream = await client.chat.completions.create(
            model="any", messages=PROMPT, max_tokens=LONG, temperature=0, stream=True
        )
        async for chunk in stream:
            n += 1
            models.add(chunk.model)
            text += chunk.choices[0].delta.content or ""
            if n == 20:
                await asyncio.to_thread(handoff, proxy)
        return text, models

    text, models = asyncio.run(run())
    assert len(models) == 2 and direct_text(primary.url, LONG) != text
    assert len(text.split()) > LONG * 0.8


def test_primary_killed_at_random_points(start_server, start_proxy, fallback: LlamaServer) -> None:
    rng = random.Random(7)
    for _ in range(4):
        primary = start_server("primary")
        # A kill may land before the fallback is proven (the answer waits for the proof).
        proxy = start_proxy(primary.url, [fallback.url])
        cut = rng.randint(1, 180)
        stream = read_stream(
            proxy.url, chat_body(LONG), on_chunk=lambda n, p=primary, c=cut: n == c and p.kill()
        )
        assert_one_clean_stream(stream)
        assert len(stream.notes) == 1 and "127.0.0.1" in stream.notes[0]
        # The proxy may have received more than the client had read when the kill landed.
        assert stream.segment_tokens[0] >= cut - 1
        primary_after = start_server("primary")
        assert_exact_splice(stream, primary_after.url, fallback.url, LONG)


def test_an_answer_cut_before_its_fallback_is_proven_waits_for_the_proof(
    start_server, start_proxy, fallback: LlamaServer
) -> None:
    """The primary dies while the proxy is still proving its fallback (held stopped from
    before the proxy starts until after the kill, as a fallback still loading its model
    answers nothing): the answer waits for the proof under way and goes on there, exactly,
    instead of ending in-band for want of it ("not checked yet")."""
    primary = start_server("primary")
    resumed: list[float] = []

    def resume_fallback() -> None:
        os.kill(fallback.pid, signal.SIGCONT)
        resumed.append(time.monotonic())

    resume = threading.Timer(0.5, resume_fallback)

    def kill_at_the_fifth(n: int) -> None:
        if n == 5 and not resume.is_alive() and not resumed:
            primary.kill()
            resume.start()

    try:
        with held(fallback):  # until the timer lets it go on (or the test ends)
            proxy = start_proxy(primary.url, [fallback.url])
            stream = read_stream(proxy.url, chat_body(LONG), on_chunk=kill_at_the_fifth)
    finally:
        resume.cancel()
    assert_one_clean_stream(stream)
    assert len(stream.notes) == 1 and "127.0.0.1" in stream.notes[0]
    assert resumed  # the kill came while the fallback was held
    assert_exact_splice(stream, start_server("primary").url, fallback.url, LONG)


def test_in_band_error_from_the_primary_hands_off(start_proxy, fallback: LlamaServer) -> None:
    """Fake primary: a real llama-server cannot be made to send an error event on demand."""
    fake = FakeUpstream([
        (STREAM_HEAD + chunked(sse_chunk(role=True), sse_chunk(" the"), sse_chunk(" river")), 0.05),
        (chunked(b'data: {"error":{"code":500,"message":"Context size has been exceeded."}}'), 0),
        (chunked(b"\n\n"), 0),
        (b"0\r\n\r\n", 0),
    ])  # fmt: skip
    proxy = start_proxy(fake.url, [fallback.url])
    proxy.servers_known()
    stream = read_stream(proxy.url, chat_body(60))
    assert_one_clean_stream(stream)
    assert "Context size has been exceeded" in stream.notes[0]
    assert stream.segments[0] == " the river"
    assert stream.segments[1] == continuation(fallback.url, " the river", 58)
    fake.close()


def test_handoff_right_before_the_primarys_finish(start_proxy, fallback: LlamaServer) -> None:
    """Fake primary: it stalls before its finish chunk, so the cut lands exactly there."""
    fake = FakeUpstream([
        (STREAM_HEAD + chunked(sse_chunk(role=True), sse_chunk(" the"), sse_chunk(" river")), 2),
        (chunked(sse_chunk(finish="length"), b"data: [DONE]\n\n") + b"0\r\n\r\n", 0),
    ])  # fmt: skip
    proxy = start_proxy(fake.url, [fallback.url])
    proxy.servers_known()
    stream = read_stream(proxy.url, chat_body(3), on_chunk=handoff_after(proxy, 3))
    assert_one_clean_stream(stream)
    assert stream.segments == [" the river", continuation(fallback.url, " the river", 1)]
    assert stream.segment_tokens == [2, 1] and stream.finishes == ["length"]
    (sent,) = [json.loads(r) for r in fake.requests if MARKER.encode() not in r]  # not the probe
    assert sent["max_tokens"] == 3
    fake.close()


def test_handoff_before_the_first_token(start_proxy, fallback: LlamaServer) -> None:
    """Fake primary: it sends the role delta and stalls, so the cut lands before any text."""
    fake = FakeUpstream([(STREAM_HEAD + chunked(sse_chunk(role=True)), 5)])
    proxy = start_proxy(fake.url, [fallback.url])
    proxy.servers_known()
    stream = read_stream(proxy.url, chat_body(40), on_chunk=handoff_after(proxy, 1))
    assert_one_clean_stream(stream)
    assert stream.segments == ["", direct_text(fallback.url, 40)]
    assert stream.chunks[0]["id"] == "chatcmpl-fake"  # the first leg's id, kept throughout
    fake.close()


NOTHING_LEFT = {
    # It stalls between its finish chunk and [DONE]: the answer is whole.
    "after its finish": (
        chunked(sse_chunk(role=True), sse_chunk(" the"), sse_chunk(finish="stop")), 30,
        chunked(b"data: [DONE]\n\n"), " the", "stop",
    ),
    # It has written all max_tokens (2) and stalls before its finish chunk: another server
    # would write one token more than the client allowed.
    "after the last allowed token": (
        chunked(sse_chunk(role=True), sse_chunk(" the"), sse_chunk(" river")), 2,
        chunked(sse_chunk(finish="length"), b"data: [DONE]\n\n"), " the river", "length",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(NOTHING_LEFT))
def test_a_handoff_with_nothing_left_to_move_is_refused(
    start_proxy, fallback: LlamaServer, case: str
) -> None:
    """Fake primary, stalled for a second where a real llama-server cannot be made to."""
    before, max_tokens, after, text, finish = NOTHING_LEFT[case]
    fake = FakeUpstream([(STREAM_HEAD + before, 1), (after + b"0\r\n\r\n", 0)])
    proxy = start_proxy(fake.url, [fallback.url])
    proxy.servers_known()
    counts: list[int] = []
    stream = read_stream(
        proxy.url,
        chat_body(max_tokens),
        on_chunk=lambda n: n == 3 and counts.append(handoff(proxy)),
    )
    assert counts == [0]
    assert_one_clean_stream(stream)
    assert stream.segments == [text] and stream.finishes == [finish]
    fake.close()


def test_garbage_from_the_primary_hands_off_without_passing_it_on(
    start_proxy, fallback: LlamaServer
) -> None:
    """Fake primary: byte-exact garbage after two good chunks."""
    fake = FakeUpstream([
        (STREAM_HEAD + chunked(sse_chunk(role=True), sse_chunk(" the")), 0.05),
        (chunked(b"data: {\"choices\": [garbage\xff\xfe\n\n"), 0.05),
        (b"0\r\n\r\n", 0),
    ])  # fmt: skip
    proxy = start_proxy(fake.url, [fallback.url])
    proxy.servers_known()
    stream = read_stream(proxy.url, chat_body(30))
    assert_one_clean_stream(stream)
    assert "garbled" in stream.notes[0]
    assert stream.segments == [" the", continuation(fallback.url, " the", 29)]
    fake.close()


def test_a_garbled_event_with_nowhere_to_go_reaches_the_client_as_sent(start_proxy) -> None:
    """Fake primary: one event in the middle is not JSON, the rest of the answer is fine.
    With no server that could go on, the event is no reason to end the answer: the client
    gets every byte the server sent, the bad event included, as it would without the
    proxy (what to make of the event is its SDK's affair)."""
    words = [" the", " river", " ran", " under", " the", " old", " bridge", " again"]
    events = [
        sse_chunk(role=True), *(sse_chunk(w) for w in words[:4]),
        b'data: {"choices": [garbage\xff\n\n',
        *(sse_chunk(w) for w in words[4:]), sse_chunk(finish="length"), b"data: [DONE]\n\n",
    ]  # fmt: skip
    fake = FakeUpstream([(STREAM_HEAD + chunked(*events) + b"0\r\n\r\n", 0)])
    proxy = start_proxy(fake.url, [])
    proxy.servers_known()

    def body_from(url: str) -> bytes:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat_body(8)) as reply:
            return reply.read()

    through = body_from(proxy.url)
    assert through == body_from(fake.url) == b"".join(events)
    status = httpx.get(f"{proxy.url}/spillover/status").json()
    assert status["recent_handoffs"] == []
    # mitmproxy reached the splice endpoint in process (answer/inprocess.py), not by TCP.
    endpoint = status["splice_endpoint"]
    assert (endpoint["in process"], endpoint["over loopback TCP"], endpoint["open"]) == (1, 0, 0)
    fake.close()


OVERSIZED = b'data: {"choices": [{"delta": {"content": "' + b"x" * (17 << 20) + b'"}}]}\n\n'


def oversized_stream() -> list[bytes]:
    """A stream whose third event is over the 16 MiB any event is read up to."""
    return [
        sse_chunk(role=True), sse_chunk(" the"), OVERSIZED, sse_chunk(" river"),
        sse_chunk(finish="length"), b"data: [DONE]\n\n",
    ]  # fmt: skip


def test_an_oversized_event_with_nowhere_to_go_reaches_the_client_as_sent(start_proxy) -> None:
    """Fake primary: no real server writes a 17 MiB event on demand. With no server
    that could go on, the event and the rest of the stream go out as the server sent
    them, and the answer ends as the server ends it."""
    events = oversized_stream()
    fake = FakeUpstream([(STREAM_HEAD + chunked(*events) + b"0\r\n\r\n", 0)])
    proxy = start_proxy(fake.url, [])
    proxy.servers_known()
    with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=chat_body(8)) as reply:
        assert reply.read() == b"".join(events)
    assert httpx.get(f"{proxy.url}/spillover/status").json()["recent_handoffs"] == []
    fake.close()


def test_an_oversized_event_hands_off_where_a_server_can_go_on(
    start_proxy, fallback: LlamaServer
) -> None:
    """Fake primary, as above; with a proven fallback, the answer goes on there from
    the text the client has, and the event never reaches the client."""
    events = oversized_stream()
    fake = FakeUpstream([(STREAM_HEAD + chunked(*events) + b"0\r\n\r\n", 0)])
    proxy = start_proxy(fake.url, [fallback.url])
    proxy.servers_known()
    stream = read_stream(proxy.url, chat_body(30))
    assert_one_clean_stream(stream)
    assert "garbled stream" in stream.notes[0] and "over 16777216 bytes" in stream.notes[0]
    assert stream.segments == [" the", continuation(fallback.url, " the", 29)]
    fake.close()


def test_dead_primary_starts_on_the_fallback(start_proxy, fallback: LlamaServer) -> None:
    proxy = start_proxy(f"http://127.0.0.1:{free_port()}", [fallback.url])
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="none")
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="any",
            messages=PROMPT,
            max_tokens=60,
            temperature=0,
            stream=True,
            extra_body={"cache_prompt": False},  # read whole, as direct_text reads it
        )
        if c.choices
    )
    assert text == direct_text(fallback.url, 60)


def test_primary_503_before_any_byte_starts_on_the_fallback(
    start_proxy, fallback: LlamaServer
) -> None:
    """Fake primary: llama-server answers 503 only while loading, too briefly to catch."""
    fake = FakeUpstream([(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n", 0)])
    proxy = start_proxy(fake.url, [fallback.url])
    proxy.servers_known()
    stream = read_stream(proxy.url, chat_body(50))
    assert_one_clean_stream(stream)
    assert "HTTP 503" in stream.notes[0]
    assert stream.text == direct_text(fallback.url, 50)
    fake.close()


def test_no_fallback_left_ends_with_an_in_band_error(start_server, start_proxy) -> None:
    primary = start_server("primary")
    proxy = start_proxy(primary.url, [f"http://127.0.0.1:{free_port()}"])
    stream = read_stream(proxy.url, chat_body(LONG), on_chunk=lambda n: n == 50 and primary.kill())
    assert stream.status == 200 and stream.done == 0
    assert stream.errors and "no server could continue" in stream.errors[0]["error"]["message"]
    assert stream.segment_tokens[0] >= 49  # what was delivered stays delivered
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="none")
    with pytest.raises(openai.APIError, match="no server could continue"):
        list(
            client.chat.completions.create(model="any", messages=PROMPT, max_tokens=20, stream=True)
        )


def test_pressure_with_nowhere_to_go_keeps_the_primary(start_server, start_proxy) -> None:
    primary = start_server("primary")
    proxy = start_proxy(primary.url, [])
    counts = []
    stream = read_stream(
        proxy.url, chat_body(150), on_chunk=lambda n: n == 10 and counts.append(handoff(proxy))
    )
    assert counts == [0]
    assert_one_clean_stream(stream)
    assert stream.text == direct_text(primary.url, 150)


def _requests_processing(server: LlamaServer) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("llamacpp:requests_processing"):
            return float(line.split()[-1])
    raise AssertionError("no requests_processing metric")


@pytest.mark.parametrize("after_handoff", [False, True])
def test_client_disconnect_cancels_the_legs(start_server, start_proxy, after_handoff: bool) -> None:
    # 4,096-token slots: room for the whole 3,000-token answer on either server. The
    # fallback runs the slower model too, so it is still writing when its load is read.
    primary = start_server("primary", ctx_size=16384)
    fallback = start_server("primary", ctx_size=16384)
    proxy = start_proxy(primary.url, [fallback.url])
    with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=chat_body(3000)) as r:
        lines = r.iter_lines()
        for _ in range(10):
            next(lines)
        if after_handoff:
            assert handoff(proxy) == 1
            while not next(lines).startswith(":"):
                pass
            # The note goes out before the continuation is asked for: its first chunk
            # says the fallback is writing.
            while not next(lines).startswith("data: {"):
                pass
        busy = fallback if after_handoff else primary
        assert _requests_processing(busy) == 1
    left = time.monotonic()
    while _requests_processing(busy) and time.monotonic() - left < 5:
        time.sleep(0.01)
    assert _requests_processing(busy) == 0
    assert _requests_processing(primary) == 0
    assert httpx.get(proxy.url + "/spillover/status").json()["live"] == []
    # A client leaving is ordinary: no traceback in the proxy's log.
    assert "Traceback" not in proxy.log_path.read_text(errors="replace")


def test_sixteen_streams_handed_off_at_once(start_server, start_proxy) -> None:
    # 4,096-token slots: the rest of every answer surely fits on the fallback, by a bound
    # from its size in bytes however far the primary ran ahead, so each is cut the moment
    # it is asked (a room check would let the held primary's buffered tokens finish some
    # answers first; with 1,024-token slots a loaded machine saw 6 of 16 cut). Answers of
    # 1,000 tokens: with 300, one could end while the last stream reached the barrier.
    primary = start_server("primary", slots=16, ctx_size=65536)
    fallback = start_server("fallback", slots=16, ctx_size=65536)
    proxy = start_proxy(primary.url, [fallback.url])
    streams = [RawStream() for _ in range(16)]
    # One client, built before the threads, and the requests sent together: sixteen
    # clients built one after another spread the starts, and the first answer could end
    # before the last stream reached the barrier.
    client = httpx.Client(timeout=120, limits=httpx.Limits(max_connections=32))
    go, ready = threading.Barrier(16, timeout=60), threading.Barrier(17, timeout=120)

    def read(stream: RawStream) -> None:
        waited = False
        try:
            go.wait()
            body = chat_body(1000)
            with client.stream("POST", f"{proxy.url}/v1/chat/completions", json=body) as r:
                stream.status = r.status_code
                for line in r.iter_lines():
                    record(stream, line)
                    if not waited and len(stream.chunks) == 5:
                        waited = True
                        ready.wait()
        finally:
            if not waited:
                ready.abort()  # the test fails at once rather than waiting on this stream

    threads = [threading.Thread(target=read, args=(s,)) for s in streams]
    for thread in threads:
        thread.start()
    ready.wait()
    with held(primary):  # no stream may finish while the handoff is on its way
        moved = handoff(proxy)
    assert moved == 16, [(len(s.chunks), s.finishes, s.notes) for s in streams]
    for thread in threads:
        thread.join()
    client.close()
    alone = solo_steps(primary.url, 1000)
    for stream in streams:
        assert_one_clean_stream(stream)
        assert len(stream.notes) == 1
        assert_splice_up_to_ties(stream, alone, fallback.url, 1000)


def test_recording_keeps_the_stitched_answer(
    start_proxy, primary: LlamaServer, fallback: LlamaServer, tmp_path: Path
) -> None:
    flows_file = tmp_path / "session.flows"
    proxy = start_proxy(primary.url, [fallback.url], options=[f"save_stream_file={flows_file}"])
    stream = read_stream(proxy.url, chat_body(LONG), on_chunk=handoff_after(proxy, 20, primary))
    proxy.stop()
    with flows_file.open("rb") as f:
        flows = list(io.FlowReader(f).stream())
    (flow,) = [fl for fl in flows if "spillover" in fl.metadata]
    # Each leg is a flow of its own: what the server was asked, what came back, how it ended.
    legs = {
        fl.id: fl
        for fl in flows
        if (fl.metadata.get("spillover_exchange") or {}).get("leg") is not None
    }
    assert list(legs) == flow.metadata["spillover"]["legs"]
    first, second = legs.values()
    assert [
        first.metadata["spillover_exchange"]["outcome"],
        second.metadata["spillover_exchange"]["outcome"],
    ] == ["handed off", "complete"]
    assert first.request.port == primary.port and second.request.port == fallback.port
    assert all(fl.metadata["spillover_exchange"]["answer"] == flow.id for fl in legs.values())
    said = recorded_stream(first.response.content)
    assert said.text.startswith(stream.segments[0])  # the cut leg holds what went out of it
    # The questions the addon asked the servers at start are flows too.
    asked = {
        (fl.request.port, fl.request.path)
        for fl in flows
        if (fl.metadata.get("spillover_exchange") or {}).get("purpose") == "question"
    }
    assert {
        (primary.port, "/props"),
        (fallback.port, "/props"),
        (fallback.port, "/tokenize"),
    } <= asked
    assert flow.marked and "handoff" in flow.comment
    assert flow.request.port == primary.port  # shown as sent to the primary
    (record_,) = flow.metadata["spillover"]["handoffs"]
    assert record_["source"] == primary.url and record_["target"] == fallback.url
    assert record_["at_token"] == stream.segment_tokens[0]
    assert record_["pause_ms"] > 0
    recorded = recorded_stream(flow.response.content)
    assert recorded.segments == stream.segments and recorded.done == 1


def test_without_upstream_flows_only_the_client_flows_are_recorded(
    start_proxy, primary: LlamaServer, fallback: LlamaServer, tmp_path: Path
) -> None:
    flows_file = tmp_path / "session.flows"
    options = [f"save_stream_file={flows_file}", "spillover_upstream_flows=false"]
    proxy = start_proxy(primary.url, [fallback.url], options=options)
    stream = read_stream(proxy.url, chat_body(LONG), on_chunk=handoff_after(proxy, 20, primary))
    proxy.stop()
    with flows_file.open("rb") as f:
        flows = list(io.FlowReader(f).stream())
    assert not [fl for fl in flows if "spillover_exchange" in fl.metadata]
    (flow,) = [fl for fl in flows if "spillover" in fl.metadata]
    assert len(stream.notes) == 1 and "legs" not in flow.metadata["spillover"]
