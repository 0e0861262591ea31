"""A handoff never kills a healthy answer: with nowhere to go it stays where it is, and a
server left on request takes the answer back when the one it went to fails."""

from __future__ import annotations

import httpx

from tests.streams import assert_one_clean_stream, chat_body, direct_text, read_stream
from tests.test_splice import held

CONTROL = httpx.Client()


def test_a_requested_handoff_with_no_room_anywhere_leaves_the_answer(
    start_server, start_proxy
) -> None:
    primary = start_server("primary")
    small = start_server("fallback", ctx_size=256, slots=1)  # 256 tokens per slot
    proxy = start_proxy(primary.url, [small.url])
    proxy.servers_known()
    moved: list[int] = []

    def ask(n: int) -> None:
        if n == 20:
            moved.append(CONTROL.post(f"{proxy.url}/spillover/handoff").json()["handed_off"])

    stream = read_stream(proxy.url, chat_body(600), on_chunk=ask)
    assert moved == [0]
    assert_one_clean_stream(stream)
    assert stream.notes == []
    assert stream.text == direct_text(primary.url, 600)


def test_the_primary_takes_the_answer_back_when_the_fallback_fails(
    start_server, start_proxy
) -> None:
    primary = start_server("primary")
    # A fallback that answers the addon's questions (it has the fallback's key: the
    # handoff is decided before the cut, by asking it) but refuses the answer itself: the
    # client's credentials are forwarded to it instead of that key, and it wants the key.
    locked = start_server("fallback", extra_args=["--api-key", "the-key"])
    keyed = [f"spillover_server_keys={locked.url}=the-key",
             f"spillover_forward_credentials={locked.url}"]  # fmt: skip
    proxy = start_proxy(primary.url, [locked.url], options=keyed)
    assert proxy.servers_known()[locked.url]["continues"] is True
    moved: list[int] = []

    # Whatever a requester says, the handoff is a requested one, and its reason is short.
    says = {"reason": "memory pressure on nvml:0\n" + "x" * 1000}

    def ask(n: int) -> None:
        if n == 20:
            with held(primary):
                reply = CONTROL.post(f"{proxy.url}/spillover/handoff", json=says)
                moved.append(reply.json()["handed_off"])

    stream = read_stream(proxy.url, chat_body(300), on_chunk=ask)
    assert moved == [1]
    assert_one_clean_stream(stream)
    there, back = stream.notes
    assert f"{primary.url} -> {locked.url}" in there
    assert "(requested by POST /spillover/handoff: memory pressure on nvml:0 xxx" in there
    assert "x" * 200 not in there
    assert f"{locked.url} -> {primary.url}" in back and "HTTP 401" in back
    assert stream.segments[1] == ""
    assert sum(stream.segment_tokens) == 300
    metrics = CONTROL.get(f"{proxy.url}/spillover/metrics").text
    assert 'spillover_handoffs_total{kind="requested"} 1.0' in metrics
    assert 'spillover_handoffs_total{kind="failure"} 1.0' in metrics
