"""The addon's options, hooks and command, in-process with mitmproxy's test helpers."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from mitmproxy.addons.proxyserver import Proxyserver
from mitmproxy.test import taddons, tflow

from addon.answer.endpoint import FRAMING_HEADER, TOKEN_HEADER
from addon.servers.upstream import Upstream
from addon.surface.proxy import Spillover
from scripts.testbed.scripted_upstream import STREAM_HEAD, FakeUpstream, chunked, sse_chunk


def chat_flow(body: dict | bytes, path: str = "/v1/chat/completions", method: str = "POST"):
    flow = tflow.tflow()
    flow.request.method = method
    flow.request.path = path
    flow.request.host, flow.request.port = "127.0.0.1", 8081
    flow.request.content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return flow


STREAMING = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 9}


def test_fallbacks_option_is_the_ladder() -> None:
    addon = Spillover()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, spillover_fallbacks=" http://a:1/, ,http://b:2")
        assert addon.fleet.fallbacks == [Upstream("http://a:1"), Upstream("http://b:2")]


def test_only_chat_completions_are_spliced() -> None:
    async def run() -> None:
        addon = Spillover()
        with taddons.context(addon, Proxyserver()) as tctx:  # Proxyserver owns the options
            await addon.running()
            assert tctx.options.connection_strategy == "lazy"
            # No view and no -w file keeps a flow here: an answer is not kept whole.
            assert not tctx.options.store_streamed_bodies
            for untouched in (
                chat_flow({**STREAMING, "n": 2}),
                chat_flow({"messages": "not a list", "stream": True}),
                chat_flow({"prompt": [1, 2, 3], "stream": True}, path="/v1/completions"),
                chat_flow(STREAMING, path="/v1/embeddings"),
                chat_flow(b"", path="/v1/models", method="GET"),
                chat_flow(b"{not json"),
                chat_flow(b"[1, 2]"),
            ):
                await addon.request(untouched)
                assert (
                    untouched.request.port == 8081 and TOKEN_HEADER not in untouched.request.headers
                )
            spliced = chat_flow(STREAMING)
            await addon.request(spliced)
            assert spliced.request.port == addon.endpoint.port
            assert spliced.request.headers[TOKEN_HEADER]
            spliced.response = tflow.tresp()
            addon.responseheaders(spliced)
            assert spliced.response.stream is True
            assert spliced.request.port == 8081 and TOKEN_HEADER not in spliced.request.headers
            whole = chat_flow({**STREAMING, "stream": False})
            await addon.request(whole)
            whole.response = tflow.tresp()
            addon.responseheaders(whole)
            assert whole.request.port == 8081 and whole.response.stream is False
            await addon.done()

    asyncio.run(run())


def test_without_its_endpoint_the_addon_lets_traffic_through() -> None:
    addon = Spillover()
    with taddons.context(addon):
        flow = chat_flow(STREAMING)
        asyncio.run(addon.request(flow))  # running() never happened: no endpoint
        assert flow.request.port == 8081


async def _control_routes_answer_clearly() -> None:
    addon = Spillover()
    with taddons.context(addon) as tctx:
        status = chat_flow(b"", path="/spillover/status", method="GET")
        await addon.request(status)
        assert (
            status.response.status_code == 200 and json.loads(status.response.content)["live"] == []
        )
        bad = chat_flow(b"[1]", path="/spillover/handoff")
        await addon.request(bad)
        assert bad.response.status_code == 400
        unknown = chat_flow(b"", path="/spillover/nothing", method="GET")
        await addon.request(unknown)
        assert unknown.response.status_code == 404
        tctx.configure(addon, spillover_control=False)
        off = chat_flow(b"", path="/spillover/status", method="GET")
        await addon.request(off)
        assert off.response is None


def test_control_routes_answer_clearly() -> None:
    asyncio.run(_control_routes_answer_clearly())


def test_health_waits_for_every_mode_of_the_proxy() -> None:
    """Before mitmproxy's `running` hook some modes may not be up yet (the local capture's
    redirector starts after the reverse port answers): health says 503 until then."""

    async def run() -> None:
        addon = Spillover()
        with taddons.context(addon, Proxyserver()):
            starting = chat_flow(b"", path="/spillover/health", method="GET")
            await addon.request(starting)
            assert starting.response.status_code == 503
            assert b"starting" in starting.response.content
            await addon.running()
            up = chat_flow(b"", path="/spillover/health", method="GET")
            await addon.request(up)
            assert up.response.status_code == 200 and json.loads(up.response.content)["ok"]
            await addon.done()

    asyncio.run(run())


@pytest.mark.parametrize("way", ["in process", "over loopback TCP"])
def test_handoff_command_moves_a_live_stream(way: str) -> None:
    """Drives the real endpoint the way mitmproxy would, in process and, as a mitmproxy
    that opened its connections another way would reach it, over loopback TCP; fake
    upstreams stall on demand."""
    primary = FakeUpstream([(STREAM_HEAD + chunked(sse_chunk(role=True), sse_chunk(" the")), 10)])
    fallback = FakeUpstream(
        [
            (
                STREAM_HEAD
                + chunked(sse_chunk(role=True), sse_chunk(" river"), sse_chunk(finish="length"))
                + chunked(b"data: [DONE]\n\n")
                + b"0\r\n\r\n",
                0,
            )
        ]
    )

    async def run() -> bytes:
        addon = Spillover()
        with taddons.context(addon, Proxyserver()) as tctx:
            tctx.configure(addon, spillover_fallbacks=fallback.url)
            await addon.running()
            # As a proxy is by the time traffic flows: it knows the fallback continues.
            for _ in range(1000):
                if addon.fleet.continues(Upstream(fallback.url), "chat"):
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError(addon.fleet.servers.get(Upstream(fallback.url)))
            flow = chat_flow(STREAMING)
            flow.request.port = primary.port
            await addon.request(flow)
            if way == "in process":
                reader, writer = await asyncio.open_connection(*addon.endpoint.address)
            else:
                opened = socket.create_connection(addon.endpoint.address)
                reader, writer = await asyncio.open_connection(sock=opened)
            body = flow.request.content
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n%s: %s\r\n"
                b"content-length: %d\r\n\r\n%s"
                % (
                    TOKEN_HEADER.encode(),
                    flow.request.headers[TOKEN_HEADER].encode(),
                    len(body),
                    body,
                )
            )
            received = b""
            while b" the" not in received:
                received += await reader.read(65536)
            assert "spillover.handoff" in tctx.master.commands.commands
            assert addon.handoff([flow]) == 1
            assert addon.handoff([flow]) == 0  # one at a time
            while data := await reader.read(65536):  # a streamed answer ends with its connection
                received += data
            assert "handoff" in flow.comment and flow.marked
            assert flow.metadata["spillover"]["handoffs"][0]["at_token"] == 1
            writer.close()
            await asyncio.sleep(0.01)  # (a connection's loss is told in a callback of its own)
            assert addon.endpoint.status() == {
                "in process": int(way == "in process"),
                "over loopback TCP": int(way != "in process"),
                "open": 0,
                "handed over": 0,  # (no mitmproxy in between to hand over from)
            }
            await addon.done()
            return received

    received = asyncio.run(run())
    assert b" river" in received and received.count(b"[DONE]") == 1
    assert received.endswith(b"data: [DONE]\n\n")  # no chunk framing, its place marked:
    head = received.split(b"\r\n\r\n")[0].split(b"\r\n")
    assert head[1:] == [b"content-type: text/event-stream", FRAMING_HEADER + b": transfer-encoding"]
    # The fallback is also asked once, at start, whether it echoes a prefill (marker Zq7).
    (continued,) = [json.loads(r) for r in fallback.requests if b"Zq7" not in r and r]
    assert continued["messages"][-1] == {"role": "assistant", "content": " the"}
    primary.close()
    fallback.close()


def test_control_routes_are_closed_to_strangers(tmp_path) -> None:
    """Other machines' requests for the control routes go on to the primary as any request
    would, unless they bear the control token; the token never stays in the flow."""

    async def run() -> None:
        addon = Spillover()
        with taddons.context(addon) as tctx:
            stranger = chat_flow(b"", path="/spillover/status", method="GET")
            stranger.client_conn.peername = ("192.0.2.7", 40000)
            stranger.request.headers["authorization"] = "Bearer client-secret"
            await addon.request(stranger)
            assert stranger.response is None
            assert stranger.request.headers["authorization"] == "Bearer client-secret"
            (tmp_path / "token").write_text("s3cret\n")
            tctx.configure(addon, spillover_control_token=f"@{tmp_path / 'token'}")
            for presented, answered in (("Bearer wrong", False), ("Bearer s3cret", True)):
                flow = chat_flow(b"", path="/spillover/status", method="GET")
                flow.client_conn.peername = ("::ffff:192.0.2.7", 40000)
                flow.request.headers["authorization"] = presented
                await addon.request(flow)
                assert (flow.response is not None) is answered
                assert ("authorization" in flow.request.headers) is not answered
            mapped_loopback = chat_flow(b"", path="/spillover/status", method="GET")
            mapped_loopback.client_conn.peername = ("::ffff:127.0.0.1", 40000)
            await addon.request(mapped_loopback)
            assert mapped_loopback.response.status_code == 200

    asyncio.run(run())


def test_a_requested_handoff_is_counted_as_requested_whatever_its_reason() -> None:
    async def run() -> None:
        addon = Spillover()
        with taddons.context(addon):
            for body, status in (
                ({"flow": 7}, 400),
                ({"flow": ["a"]}, 400),
                ({"reason": {"x": 1}}, 400),
                ({"flow": "no-such-flow", "reason": "memory pressure on nvml:0"}, 200),
            ):
                flow = chat_flow(json.dumps(body).encode(), path="/spillover/handoff")
                await addon.request(flow)
                assert flow.response.status_code == status, body
                assert flow.request.host == "127.0.0.1" and flow.request.port == 8081

    asyncio.run(run())


DEEP = b"[" * 100_000 + b"]" * 100_000


def test_odd_control_bodies_are_answered_by_the_addon_and_never_forwarded(caplog) -> None:
    """A body nested too deep to parse, one that is not in its Content-Encoding, one in an
    encoding nobody knows, and a drain of a server the proxy does not have: each is
    answered 400 or 404 with a JSON error, logs nothing, and keeps nothing."""

    async def run() -> None:
        addon = Spillover()
        with taddons.context(addon) as tctx:
            tctx.configure(addon, spillover_fallbacks="http://127.0.0.1:8082")
            cases = []
            for route in ("handoff", "drain", "undrain"):
                cases.append((route, DEEP, None, 400))
                cases.append((route, b"\x1f\x8b not gzip", "gzip", 400))
                cases.append((route, b"{}", "x-unknown", 400))
            cases.append(("drain", json.dumps({"server": "http://" + "a" * 100_000}), None, 404))
            for route, content, encoding, status in cases:
                flow = chat_flow(b"", path=f"/spillover/{route}")
                flow.request.raw_content = (
                    content if isinstance(content, bytes) else content.encode()
                )
                if encoding:
                    flow.request.headers["content-encoding"] = encoding
                await addon.request(flow)
                assert flow.response is not None and flow.response.status_code == status, route
                assert "error" in json.loads(flow.response.content), route
            assert addon.fleet.router.draining == set()
            spellings = (
                "http://127.0.0.1:8082", "http://127.0.0.1:8082/", " http://localhost:8082",
                "http://LOCALHOST:8082/",
            )  # fmt: skip
            for drained in spellings:
                flow = chat_flow(json.dumps({"server": drained}).encode(), path="/spillover/drain")
                await addon.request(flow)
                assert flow.response.status_code == 200, drained
                assert json.loads(flow.response.content)["server"] == "http://127.0.0.1:8082"
            assert addon.fleet.router.draining == {"http://127.0.0.1:8082"}
            for other in ("http://localhost:8083", "https://localhost:8082", "http://example.com"):
                flow = chat_flow(json.dumps({"server": other}).encode(), path="/spillover/drain")
                await addon.request(flow)
                assert flow.response.status_code == 404, other
            assert addon.fleet.router.draining == {"http://127.0.0.1:8082"}

    asyncio.run(run())
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "WARNING")]


def test_a_body_nested_too_deep_is_passed_through_untouched() -> None:
    async def run() -> None:
        addon = Spillover()
        with taddons.context(addon, Proxyserver()):
            await addon.running()
            nested = b"[" * 300 + b"]" * 300
            for content in (
                DEEP,
                b'{"messages": ' + DEEP + b', "stream": true}',
                b'{"messages": [{"role": "user", "content": ' + nested + b'}], "stream": true}',
            ):
                flow = chat_flow(content)
                await addon.request(flow)
                assert flow.request.port == 8081 and flow.response is None
            await addon.done()

    asyncio.run(run())
