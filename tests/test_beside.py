"""docs/beside.md's blocks that can run here, run by bash as written: LiteLLM in front of
the proxy and RAMP as its primary (each installed from PyPI into an environment of its
own: scripts/testbed/beside.py), with the tiny models on the CPU. llama-swap and Ollama
are not in the registries these machines reach: their blocks are not run."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from scripts.testbed.beside import ToolUnavailable, command
from scripts.testbed.llamaserver import find_binary
from scripts.testbed.prompts import chat_body
from tests.quickstart import (
    PROXY,
    doc_block,
    quick_start_ports,
    running_as_written,
    wait_until_ready,
    your_models,
)
from tests.streams import assert_one_clean_stream, continuation, direct_text, read_stream
from tests.throttle import Throttled
from watchers.listeners import descendants, listening_pids

PAGE = "docs/beside.md"
PRIMARY, FALLBACK = "http://127.0.0.1:8081", "http://127.0.0.1:8082"
LITELLM = "http://127.0.0.1:4000"
LONG = 300


def tool(name: str) -> Path:
    try:
        return command(name)
    except ToolUnavailable as why:
        pytest.skip(f"{name} is not installed here: {why}")


def answering(url: str, timeout: float = 120) -> None:
    """Until `url` answers 200 (an AssertionError after `timeout`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} did not answer within {timeout:.0f}s")


def test_litellm_in_front_reads_one_answer_across_a_handoff(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """A handoff asked while a client reads through LiteLLM: the client gets the
    primary's own words up to the cut, then the fallback's own continuation of them, as
    one stream without the proxy's comment line (LiteLLM writes its own events)."""
    script = your_models(
        doc_block(PAGE, "## LiteLLM in front"), BIG=models["primary"], SMALL=models["fallback"]
    )
    commands = {"llama-server": find_binary(), "litellm": tool("litellm")}
    with (
        quick_start_ports(4000),
        running_as_written(script, tmp_path, commands, output=tmp_path / "printed"),
    ):
        wait_until_ready(PRIMARY, FALLBACK)
        answering(f"{LITELLM}/health/liveliness")
        key = (tmp_path / "litellm.key").read_text().strip()
        body = {**chat_body(LONG), "model": "local"}
        with Throttled(*listening_pids(8081)) as primary:

            def ask(n: int) -> None:
                if n == 3:
                    with primary.held():
                        httpx.post(f"{PROXY}/spillover/handoff")

            stream = read_stream(
                LITELLM, body, on_chunk=ask, headers={"Authorization": f"Bearer {key}"}
            )
        (handoff,) = httpx.get(f"{PROXY}/spillover/status").json()["recent_handoffs"]
        before, after = stream.text[: handoff["at_char"]], stream.text[handoff["at_char"] :]
        assert handoff["kind"] == "requested" and handoff["target"] == FALLBACK, handoff
        assert direct_text(PRIMARY, LONG).startswith(before)
        assert after and after == continuation(FALLBACK, before, LONG - handoff["at_token"])
    assert not stream.notes  # the comment line stops at LiteLLM
    assert stream.done == 1 and len({c["id"] for c in stream.chunks}) == 1
    ends = [
        ch["finish_reason"] for c in stream.chunks for ch in c["choices"] if ch.get("finish_reason")
    ]
    assert ends == ["length"]  # (LiteLLM leaves the field out of the other chunks)


def test_ramp_as_the_primary_its_swap_cuts_an_answer_the_fallback_goes_on_with(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """RAMP told to swap `big` for `mid` while an answer streams from `big` (throttled,
    as on a slow card): RAMP stops `big` once its drain wait is over, and the answer goes
    on on the fallback, whole; the next answer through the proxy comes from `mid`,
    loaded behind the same port."""
    script = your_models(
        doc_block(PAGE, "## RAMP as the primary"),
        BIG=models["primary"], MID=models["turns-fallback"], SMALL=models["fallback"],
    )  # fmt: skip
    commands = {"llama-server": find_binary(), "ramp": tool("ramp")}
    with quick_start_ports(), running_as_written(script, tmp_path, commands):
        wait_until_ready(PRIMARY, FALLBACK)
        (ramp,) = listening_pids(8081)
        swap = threading.Thread(target=lambda: httpx.post(f"{PRIMARY}/ramp/pin/mid", timeout=90))
        with Throttled(*descendants(ramp)):
            stream = read_stream(
                PROXY, chat_body(2000), on_chunk=lambda n: n == 3 and swap.start(), timeout=120
            )
        swap.join(timeout=90)
        wait_until_ready(PRIMARY)
        after_swap = httpx.post(
            f"{PROXY}/v1/chat/completions", json={**chat_body(8), "stream": False}, timeout=60
        )
        events = httpx.get(f"{PRIMARY}/ramp/status").json()["events"]
    assert len(stream.notes) == 1 and f"{PRIMARY} -> {FALLBACK}" in stream.notes[0], stream.notes
    assert_one_clean_stream(stream)
    assert sum(stream.segment_tokens) == 2000
    assert [e["to"] for e in events if e["event"] == "switch"] == ["big", "mid"], events
    assert after_swap.status_code == 200 and after_swap.headers["x-ramp-tier"] == "mid"
