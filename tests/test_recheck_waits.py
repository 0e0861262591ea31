"""A shadowed handoff sends its continuation beside the recheck at the moment of use (the
questions that say the next server still runs what the request was built for), and
reads its answer only once the recheck has spoken. Here, with real llama-servers, the
fallback hangs on one of the recheck's questions: no real server does that on demand,
so it sits behind a TCP relay (tests/tap.py) that holds its `/props` requests."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from scripts.testbed.replay import leg_flows, read_flows
from tests.streams import recorded_stream
from tests.tap import tapped
from tests.test_exact_replay import SAME_BATCHES, wait_until_known
from tests.test_shadow import ANSWER, NO_STALLS, cut_while_held, long_body

CONTROL = httpx.Client(timeout=10)


def test_a_server_hanging_on_the_rechecks_question_is_waited_on_once(
    start_server, start_proxy, tmp_path: Path
) -> None:
    """The fallback never answers the recheck's `/props`: after the recheck's timeout its
    tokenizer is unknown now, the continuation sent beside it is dropped, and the one
    built again (as text) takes that recheck's word instead of asking again and waiting
    as long again; nor is a question left unanswered taken for a server that changed (and
    learnt again: one more wait). The server is sent the question and the answer so far,
    and the client reads what it wrote after them."""
    primary = start_server("primary", ctx_size=16384, slots=2, extra_args=SAME_BATCHES)
    fallback = start_server("primary", ctx_size=16384, slots=2, extra_args=SAME_BATCHES)
    flows = tmp_path / "flows.mitm"
    with tapped(fallback.port) as tap:
        options = [f"save_stream_file={flows}", "spillover_shadow=always", *NO_STALLS]
        proxy = start_proxy(primary.url, [tap.url], options=options)
        wait_until_known(proxy, [primary.url, tap.url])
        asked_from: list[float] = []

        def hold_props() -> None:
            tap.hold(b"GET /props")
            asked_from.append(time.time())

        stream = cut_while_held(proxy, primary, True, before=hold_props, replayed="text")
        proxy.stop()  # the recording is whole
    assert stream.notes[0].endswith("replayed as text")
    # Asked once: one question in the proxy's record. (The tap may have held it twice: a
    # kept connection the server closed, idle, while the tap held the question on it, is
    # asked on once more, on a new one.)
    props = [
        flow for flow in read_flows(flows)
        if flow.metadata.get("spillover_exchange", {}).get("purpose") == "question"
        and flow.request.port == tap.port and flow.request.path == "/props"
        and flow.request.timestamp_start >= asked_from[0]
    ]  # fmt: skip
    assert len(props) == 1 and tap.held >= 1
    *_, dropped, rebuilt = leg_flows(flows, tap.port)
    assert "the server changed" in dropped.metadata["spillover_exchange"]["error"]
    assert rebuilt.metadata["spillover_exchange"]["outcome"] == "complete"
    assert rebuilt.request.path == "/v1/chat/completions"  # the answer as a prefill
    body = json.loads(rebuilt.request.content or b"")
    said = {"role": "assistant", "content": stream.segments[0]}
    assert body["messages"] == [*long_body()["messages"], said]
    assert body["max_tokens"] == ANSWER - stream.segment_tokens[0]
    assert stream.segments[1] == recorded_stream(rebuilt.response.content or b"").text
