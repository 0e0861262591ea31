"""Fallbacks the addon cannot prove by their engine's routes: a real llama-server behind a
relay that lets only the OpenAI routes through (as a gateway shows a server), judged by
how it behaves (servers/behaviour.py); a real llama-cpp-python behind the same relay,
which starts a new answer after a partial one and is refused by the same probe; and
servers whose operator declares how they continue (spillover_continue_by), checked where
they can be at the moment of use. What no real server here does on demand (echo a
partial answer, start it over, refuse it with a 400) is a scripted OpenAI-compatible
stand-in (scripts/testbed/openai_upstream.py), and said so."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from scripts.parts.processes import free_port
from scripts.testbed.llamacpppython import LlamaCppPythonServer
from scripts.testbed.mitm import Mitmdump
from scripts.testbed.openai_upstream import REFUSAL, OpenAIUpstream
from scripts.testbed.prompts import PROMPT, chat_body
from scripts.testbed.relay import Relay
from scripts.testbed.tinymodels import reasoning_template
from scripts.testbed.workers import haproxy_missing
from tests.streams import assert_one_clean_stream, continuation, read_stream

LONG = 120
CUT = 30

pytestmark = pytest.mark.skipif(haproxy_missing() is not None, reason=str(haproxy_missing()))


@pytest.fixture
def relay(server_logs: Path) -> Iterator:
    started: list[Relay] = []

    def start(target: str) -> Relay:
        relayed = Relay(target, log_dir=server_logs).start()
        started.append(relayed)
        return relayed

    yield start
    for relayed in started:
        relayed.stop()


def known(proxy, url: str) -> dict:
    return proxy.servers_known()[url]


def test_a_llama_server_behind_a_relay_is_proven_by_its_behaviour_and_continues_exactly(
    start_server, start_proxy, relay
) -> None:
    primary = start_server("primary")
    # A small batch: the probe compares its greedy continuation with its own answer.
    hidden = start_server("fallback", extra_args=["--ubatch-size", "32"])
    relayed = relay(hidden.url)
    assert httpx.post(f"{relayed.url}/apply-template", json={"messages": PROMPT}).status_code == 404
    proxy = start_proxy(primary.url, [relayed.url])
    info = known(proxy, relayed.url)
    assert info["continues"] is True and info["proof"] == "behaviour", info
    assert "routes are hidden" in info["continues_why"] and "probe" in info["continues_why"]
    stream = read_stream(proxy.url, chat_body(LONG), on_chunk=lambda n: n == CUT and primary.kill())
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert f"-> {relayed.url}" in note and "proven by its behaviour only" in note
    before, after = stream.segments
    # The relayed server's own continuation of what the client had, asked of it directly.
    assert after == continuation(hidden.url, before, LONG - stream.segment_tokens[0])
    metrics = httpx.get(f"{proxy.url}/spillover/metrics").text
    assert 'spillover_continuations_total{proof="behaviour"} 1.0' in metrics


def test_the_probe_refuses_a_server_that_starts_a_new_answer(
    models: dict[str, Path], server_logs: Path, start_server, start_proxy, relay
) -> None:
    """llama-cpp-python's chat route opens a new turn after a partial answer; behind the
    relay its tokenize route is hidden too, so only the probe can tell, and it says no."""
    new_turner = LlamaCppPythonServer(models["fallback"], log_dir=server_logs)
    new_turner.start(timeout=120)
    try:
        relayed = relay(new_turner.url)
        primary = start_server("primary")
        proxy = start_proxy(primary.url, [relayed.url])
        info = known(proxy, relayed.url)
        assert info["continues"] is False and info["proof"] is None, info
        assert "does not go on with a partial answer" in info["continues_why"] or (
            "starts the answer over" in info["continues_why"]
        )
        stream = read_stream(
            proxy.url, chat_body(LONG), on_chunk=lambda n: n == CUT and primary.kill()
        )
        message = stream.errors[0]["error"]["message"]
        assert "no server could continue" in message and relayed.url in message
        assert len(stream.segments) == 1  # what was delivered stays, nothing else follows
    finally:
        new_turner.stop()


def cut_answer(start_server, start_proxy, fallback: str, options=()) -> tuple:
    """A real primary killed at the client's CUT-th chunk, in front of `fallback`."""
    primary = start_server("primary")
    proxy = start_proxy(primary.url, [fallback], options=list(options))
    info = known(proxy, fallback)
    stream = read_stream(proxy.url, chat_body(LONG), on_chunk=lambda n: n == CUT and primary.kill())
    return info, stream


def declared(url: str, way: str) -> list[str]:
    return [f"spillover_continue_by={url}={way}"]


def test_an_echoing_server_is_found_so_and_its_echo_is_taken_out(start_server, start_proxy) -> None:
    hosted = OpenAIUpstream("hosted", mode="echo")
    info, stream = cut_answer(start_server, start_proxy, hosted.url)
    assert info["continues"] is True and info["proof"] == "behaviour"
    assert info["echoes_prefill"] is True and "echoed first" in info["continues_why"]
    assert_one_clean_stream(stream)
    before, after = stream.segments
    asked = [*PROMPT, {"role": "assistant", "content": before}]
    own = hosted.words(asked, LONG - stream.segment_tokens[0])
    assert own[0] == before and after == "".join(own[1:])  # nothing twice
    hosted.close()


def test_a_declared_server_that_starts_over_ends_the_answer_with_the_reason(
    start_proxy,
) -> None:
    """The same model on both sides, the fallback starting over after a partial answer:
    the probe finds so and says so; its operator declares it continues, and the
    declaration stands (the status says the probe disagrees). At the moment of use its
    first words are the answer's first words again: the leg ends before any of them
    reach the client, with the reason."""
    primary = OpenAIUpstream("hosted", cut_after=CUT)
    hosted = OpenAIUpstream("hosted", mode="restart")
    proxy = start_proxy(primary.url, [hosted.url], options=declared(hosted.url, "message"))
    info = known(proxy, hosted.url)
    assert info["continues"] is True and info["proof"] == "declared"
    assert "declared, not proven" in info["continues_why"]
    assert "starts the answer over" in info["probe_disagrees"]
    stream = read_stream(proxy.url, chat_body(LONG))
    message = stream.errors[0]["error"]["message"]
    assert f"{hosted.url} started the answer over instead of going on" in message
    assert stream.segments[0] == "".join(hosted.words(PROMPT, CUT))  # the primary's
    assert not "".join(stream.segments[1:])  # and nothing of the answer started over
    primary.close()
    hosted.close()


def test_a_declared_server_that_refuses_a_partial_answer_ends_it_with_its_words(
    start_server, start_proxy
) -> None:
    hosted = OpenAIUpstream("hosted", mode="refuse")
    info, stream = cut_answer(
        start_server, start_proxy, hosted.url, declared(hosted.url, "message")
    )
    assert info["continues"] is True and info["proof"] == "declared"
    assert "it refuses a partial answer (HTTP 400" in info["probe_disagrees"]
    message = stream.errors[0]["error"]["message"]
    assert f"HTTP 400 from {hosted.url}" in message and REFUSAL in message
    assert not "".join(stream.segments[1:])  # nothing after the delivered text
    hosted.close()


def test_a_declared_server_that_continues_is_said_to_be_declared_not_proven(
    start_server, start_proxy
) -> None:
    """Declared, and proven by the probe too: the declaration agrees, the status says
    both, and the note says how the server is known to continue."""
    hosted = OpenAIUpstream("hosted", mode="continue")
    info, stream = cut_answer(
        start_server, start_proxy, hosted.url, declared(hosted.url, "message")
    )
    assert info["declared"] == "message" and info["proof"] == "behaviour"
    assert info["continues_why"].endswith("declared too (message)")
    assert_one_clean_stream(stream)
    before, after = stream.segments
    asked = [*PROMPT, {"role": "assistant", "content": before}]
    assert after == "".join(hosted.words(asked, LONG - stream.segment_tokens[0]))
    assert "proven by its behaviour only" in stream.notes[0]
    hosted.close()


def test_an_unknown_way_is_refused_at_start_up() -> None:
    options = declared("http://127.0.0.1:9", "prefill")
    proxy = Mitmdump(f"http://127.0.0.1:{free_port()}", options=options)
    run = subprocess.run(proxy.argv(), capture_output=True, text=True, timeout=60)
    said = run.stdout + run.stderr
    assert run.returncode != 0
    assert "spillover_continue_by: http://127.0.0.1:9=prefill: the way is one of message" in said


def test_a_server_that_comes_back_is_judged_by_its_behaviour_again(
    start_server, start_proxy
) -> None:
    """Nothing a hosted API answers says what it runs: when one comes back after being
    down (another deployment behind the same URL, here one that starts answers over),
    the probe is asked again, and an answer no longer goes there."""
    hosted = OpenAIUpstream("hosted", mode="continue")
    port = int(hosted.url.rsplit(":", 1)[1])
    primary = start_server("primary")
    proxy = start_proxy(primary.url, [hosted.url])
    assert known(proxy, hosted.url)["continues"] is True
    hosted.close()
    status = f"{proxy.url}/spillover/status"
    deadline = time.monotonic() + 30
    while httpx.get(status).json()["routing"]["states"][hosted.url]["state"] != "down":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    changed = OpenAIUpstream("hosted", mode="restart", port=port)
    while httpx.get(status).json()["servers"][hosted.url]["continues"] is not False:
        assert time.monotonic() < deadline + 30
        time.sleep(0.1)
    assert (
        "starts the answer over" in httpx.get(status).json()["servers"][hosted.url]["continues_why"]
    )
    changed.close()


def test_a_reasoning_answer_does_not_go_to_a_server_proven_on_plain_answers_only(
    models: dict[str, Path], start_server, start_proxy
) -> None:
    """A llama-server primary with the reasoning template thinks aloud and is killed:
    the fallback known by its behaviour only was seen to go on with plain answers, and
    where this answer's reasoning would go there is not known: it ends in-band, saying so,
    after the reasoning already delivered."""
    template = str(reasoning_template(models["primary"].parent))
    primary = start_server("primary", extra_args=["--chat-template-file", template])
    hosted = OpenAIUpstream("hosted")
    proxy = start_proxy(primary.url, [hosted.url])
    assert known(proxy, hosted.url)["proof"] == "behaviour"
    stream = read_stream(proxy.url, chat_body(LONG), on_chunk=lambda n: n == 20 and primary.kill())
    assert stream.thoughts[0] and not stream.segments[0]
    message = stream.errors[0]["error"]["message"]
    assert f"{hosted.url} is proven by its behaviour only, on plain answers" in message
    assert len(hosted.requests) == 2  # the probe's: no continuation was sent there
    hosted.close()
