"""A flow the spillover addon has taken can still be answered or killed by another addon
after its request hook: then no leg must run (the splice starts when the flow reaches the
endpoint), and the primary is not left writing an answer nobody reads."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import httpx

from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.prompts import chat_body

OTHER_ADDON = """
from mitmproxy import http


class AnswersSome:
    def request(self, flow: http.HTTPFlow) -> None:
        if "x-answer-here" in flow.request.headers:
            flow.response = http.Response.make(200, b"answered by another addon")
        elif "x-kill-here" in flow.request.headers:
            flow.kill()


addons = [AnswersSome()]
"""
ANSWER = 3000  # a few seconds of tokens: the whole answer would show in the slot's cache


def settled_slot(server: LlamaServer) -> dict:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        (slot,) = httpx.get(f"{server.url}/slots").json()
        if not slot["is_processing"]:
            return slot
        time.sleep(0.02)
    raise AssertionError("the primary is still writing")


def test_a_flow_answered_or_killed_by_another_addon_stops_its_leg(
    start_server, start_proxy, tmp_path: Path
) -> None:
    primary = start_server("primary", ctx_size=4096, slots=1)
    fallback = start_server("fallback")
    script = tmp_path / "answers_some.py"
    script.write_text(OTHER_ADDON)
    proxy = start_proxy(primary.url, [fallback.url], scripts=[script])
    body = chat_body(ANSWER)
    prompt = httpx.post(
        f"{primary.url}/apply-template", json={"messages": body["messages"]}
    ).json()["prompt"]
    prompt_tokens = len(
        httpx.post(f"{primary.url}/tokenize", json={"content": prompt}).json()["tokens"]
    )

    reply = httpx.post(
        f"{proxy.url}/v1/chat/completions", json=body, headers={"x-answer-here": "1"}, timeout=30
    )
    assert reply.status_code == 200 and reply.content == b"answered by another addon"
    # The slot holds the prompt and what was written before the leg was dropped: far from
    # the whole answer, which takes seconds.
    assert settled_slot(primary).get("n_prompt_tokens", 0) < prompt_tokens + ANSWER // 2

    with contextlib.suppress(httpx.HTTPError):  # killed: the connection is dropped
        httpx.post(
            f"{proxy.url}/v1/chat/completions", json=body, headers={"x-kill-here": "1"}, timeout=30
        )
    assert settled_slot(primary).get("n_prompt_tokens", 0) < prompt_tokens + ANSWER // 2

    # And the proxy goes on serving.
    whole = httpx.post(f"{proxy.url}/v1/chat/completions", json=chat_body(20, stream=False))
    assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 20
