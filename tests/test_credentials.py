"""Credentials and headers: each server gets its own key, the client's go only to the
primary, recordings hold none of them; header bytes and the status line pass through as
the server wrote them. Real llama-servers run with --api-key."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from mitmproxy import io

from addon.servers.credentials import Credentials
from scripts.testbed.prompts import PROMPT
from tests.streams import assert_one_clean_stream, chat_body
from tests.test_splice import LONG, handoff_after

PRIMARY_KEY, FALLBACK_KEY = "primary-key-1f0c", "fallback-key-9e2a"


def stream_with(url: str, headers: dict, on_chunk=None):
    from tests.streams import RawStream, record

    stream = RawStream()
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=chat_body(LONG), headers=headers, timeout=60
    ) as r:
        stream.status = r.status_code
        for line in r.iter_lines():
            record(stream, line)
            if line.startswith("data: {") and on_chunk is not None:
                on_chunk(len(stream.chunks))
    return stream


def test_each_server_gets_its_own_key_and_recordings_hold_none(
    start_server, start_proxy, tmp_path: Path
) -> None:
    primary = start_server("primary", extra_args=["--api-key", PRIMARY_KEY])
    fallback = start_server("fallback", extra_args=["--api-key", FALLBACK_KEY])
    key_file = tmp_path / "fallback.key"
    key_file.write_text(FALLBACK_KEY + "\n")
    flows_file = tmp_path / "session.flows"
    proxy = start_proxy(
        primary.url,
        [fallback.url],
        options=[
            f"spillover_server_keys={primary.url}={PRIMARY_KEY},{fallback.url}=@{key_file}",
            f"save_stream_file={flows_file}",
        ],
    )
    known = proxy.servers_known()
    assert known[fallback.url]["slot_context"] and not known[fallback.url]["unanswered"]
    assert known[fallback.url]["tokenizer"] == known[primary.url]["tokenizer"]

    stranger = httpx.post(f"{proxy.url}/v1/chat/completions", json=chat_body(8))
    direct = httpx.post(f"{primary.url}/v1/chat/completions", json=chat_body(8))
    assert stranger.status_code == direct.status_code == 401
    assert stranger.json() == direct.json()

    client = {"authorization": f"Bearer {PRIMARY_KEY}", "x-user": "José".encode()}
    stream = stream_with(proxy.url, client, handoff_after(proxy, 20, primary))
    assert_one_clean_stream(stream)
    assert len(stream.notes) == 1 and "replayed as token ids" in stream.notes[0]
    proxy.stop()
    assert FALLBACK_KEY.encode() not in flows_file.read_bytes()
    with flows_file.open("rb") as f:
        flows = list(io.FlowReader(f).stream())
    # The client's own request is recorded as mitmproxy records any request; the legs and
    # questions the addon made hold no credential.
    addon_made = [fl for fl in flows if "spillover_exchange" in fl.metadata]
    assert not [fl for fl in flows if fl.request.path == "/health"]  # not worth a flow each
    (answer,) = [fl for fl in flows if (fl.metadata.get("spillover") or {}).get("handoffs")]
    legs = [fl for fl in addon_made if fl.id in answer.metadata["spillover"]["legs"]]
    assert len(legs) == 2 and len(addon_made) > 2
    for fl in addon_made:
        assert PRIMARY_KEY.encode() not in fl.request.raw_content
        assert all(PRIMARY_KEY not in v for v in fl.request.headers.values())
    assert [leg.request.headers.get("authorization") for leg in legs] == ["(redacted)"] * 2
    assert [leg.request.headers.get("x-user") for leg in legs] == ["José"] * 2


def test_an_x_api_key_goes_to_the_primary_only(start_server, start_proxy, tmp_path: Path) -> None:
    """Anthropic's documented key header, X-Api-Key (curl, older SDKs and agents send it;
    llama-server takes it as it takes Authorization): after a handoff of a Messages
    stream, the fallback's leg carries the owner's key for it instead, and the recorded
    legs show neither."""
    primary = start_server("primary", extra_args=["--api-key", PRIMARY_KEY])
    fallback = start_server("fallback", extra_args=["--api-key", FALLBACK_KEY])
    flows_file = tmp_path / "session.flows"
    keys = f"spillover_server_keys={primary.url}={PRIMARY_KEY},{fallback.url}={FALLBACK_KEY}"
    proxy = start_proxy(
        primary.url, [fallback.url], options=[keys, f"save_stream_file={flows_file}"]
    )
    proxy.servers_known()
    body = {"model": "tiny", "max_tokens": LONG, "messages": PROMPT, "stream": True}
    url = f"{proxy.url}/v1/messages"
    assert httpx.post(url, json=body, headers={"x-api-key": "wrong"}).status_code == 401
    on_chunk, deltas, kinds = handoff_after(proxy, 12, primary), 0, []
    with httpx.stream("POST", url, json=body, headers={"x-api-key": PRIMARY_KEY}) as r:
        for line in r.iter_lines():
            if line.startswith("event: "):
                kinds.append(line[7:])
                if line == "event: content_block_delta":
                    deltas += 1
                    on_chunk(deltas)
    assert kinds.count("message_stop") == 1 and kinds[-1] == "message_stop"
    proxy.stop()
    with flows_file.open("rb") as f:
        flows = list(io.FlowReader(f).stream())
    (answer,) = [fl for fl in flows if (fl.metadata.get("spillover") or {}).get("handoffs")]
    first, second = [fl for fl in flows if fl.id in answer.metadata["spillover"]["legs"]]
    assert first.request.headers.get("x-api-key") == "(redacted)"
    assert second.request.port == fallback.port and "x-api-key" not in second.request.headers
    assert second.request.headers.get("authorization") == "(redacted)"  # the owner's key
    addon_made = [fl for fl in flows if "spillover_exchange" in fl.metadata]
    assert all(PRIMARY_KEY not in v for fl in addon_made for v in fl.request.headers.values())


@pytest.mark.parametrize("told", [True, False], ids=["key given", "key not given"])
def test_a_primary_that_wants_a_key_sees_every_new_request_first(
    start_server, start_proxy, fallback, told: bool
) -> None:
    """Only a primary run with --api-key can judge a client's key, so no new request
    starts on an open fallback without it, even while it is drained, nor moves there when
    it is dead: whether the addon was given its key, or the primary turned the addon's
    questions away (HTTP 401)."""
    primary = start_server("primary", extra_args=["--api-key", PRIMARY_KEY])
    options = [f"spillover_server_keys={primary.url}={PRIMARY_KEY}"] if told else []
    proxy = start_proxy(primary.url, [fallback.url], options=options)
    assert proxy.servers_known()[primary.url]["wants_key"] is not told
    drain = httpx.post(f"{proxy.url}/spillover/drain", json={"server": primary.url})
    assert drain.json()["server"] == primary.url
    body = {**chat_body(8), "stream": False}
    stranger = httpx.post(f"{proxy.url}/v1/chat/completions", json=body)
    assert stranger.status_code == 401 and "x-spillover-route" not in stranger.headers
    key = {"authorization": f"Bearer {PRIMARY_KEY}"}
    client = httpx.post(f"{proxy.url}/v1/chat/completions", json=body, headers=key)
    assert client.status_code == 200 and "x-spillover-route" not in client.headers
    primary.kill()
    for headers in ({}, key):  # as without the proxy: nobody is answered
        dead = httpx.post(f"{proxy.url}/v1/chat/completions", json=body, headers=headers)
        assert dead.status_code == 502, (headers, dead.status_code, dead.headers)


def test_without_keys_the_status_says_what_is_turned_off(start_server, start_proxy) -> None:
    primary = start_server("primary", extra_args=["--api-key", PRIMARY_KEY])
    proxy = start_proxy(primary.url, [])
    (unanswered,) = [proxy.servers_known()[primary.url]["unanswered"]]
    assert unanswered["/props"].startswith("HTTP 401; turns off room checks")
    # Builds differ in what they serve without the key: recent ones answer /v1/models
    # to anyone. The status names it exactly when this server refused it.
    models_status = httpx.get(f"{primary.url}/v1/models").status_code
    if models_status == 401:
        assert "token-exact replay" in unanswered["/v1/models"]
    else:
        assert models_status == 200 and "/v1/models" not in unanswered


def test_header_bytes_and_the_status_line_pass_through(primary, proxy) -> None:
    """A header value in UTF-8 reaches the server as it was sent; the response's status
    line and header names are the server's own."""
    headers = {"x-user": "José".encode()}
    direct = httpx.post(f"{primary.url}/v1/chat/completions", json=chat_body(4), headers=headers)
    through = httpx.post(f"{proxy.url}/v1/chat/completions", json=chat_body(4), headers=headers)
    assert through.status_code == direct.status_code == 200
    assert through.reason_phrase == direct.reason_phrase == "OK"
    with httpx.stream(
        "POST",
        f"{proxy.url}/v1/chat/completions",
        json={**chat_body(4), "stream": True},
        headers=headers,
    ) as r:
        assert r.status_code == 200 and r.reason_phrase == "OK"
        r.read()


def test_where_a_new_request_may_start_without_the_primary() -> None:
    credentials = Credentials({"http://own-key": "k"}, forward={"http://forwarded"})
    assert credentials.may_start_on("http://open", "http://primary", frozenset())
    assert not credentials.may_start_on(
        "http://open", "http://primary", frozenset({"http://primary"})
    )
    # A fallback's own key serves only clients the primary accepted.
    assert not credentials.may_start_on("http://own-key", "http://primary", frozenset())
    # One that wants a key the client's request does not bring would refuse it.
    assert not credentials.may_start_on("http://open", "http://primary", frozenset({"http://open"}))
    # Unless the client's own credentials go there too.
    assert credentials.may_start_on(
        "http://forwarded", "http://primary", frozenset({"http://forwarded"})
    )
