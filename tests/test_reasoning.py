"""Reasoning answers: the reasoning goes on on the fallback, and what follows it stays in
the content field. Both servers use the tiny models' reasoning template (the answer opens
in a <think> phase); a logit_bias on </think> makes the models close it after a while."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from scripts.tinymodels import reasoning_template
from tests.streams import PROMPT, assert_one_clean_stream, chat_body, read_stream
from tests.test_splice import handoff_after

ANSWER = 120
# How hard each request pushes </think>: the primary model then reasons for 88 tokens and
# writes 28 of content, or reasons for 23 and writes 97.
LONG_THOUGHT, SHORT_THOUGHT = 12.5, 13.0
SAME_BATCHES = ["--ubatch-size", "32"]  # see test_exact_replay.py


@pytest.fixture
def thinkers(models: dict[str, Path], start_server, start_proxy):
    """Two servers with the same model and the reasoning template, the second as the
    first's fallback."""
    template = str(reasoning_template(models["primary"].parent))
    args = ["--chat-template-file", template, *SAME_BATCHES]
    first, second = (
        start_server("primary", extra_args=args),
        start_server("primary", extra_args=args),
    )
    proxy = start_proxy(first.url, [second.url])
    close = httpx.post(f"{first.url}/tokenize", json={"content": "</think>"}).json()["tokens"]

    def body(push: float) -> dict:
        return chat_body(ANSWER, logit_bias={str(close[0]): push})

    return first, second, proxy, body


def answer(server_url: str, body: dict, reasoning: str = "", content: str = "") -> dict:
    """The server's own non-streaming answer, continuing an assistant message if given."""
    messages = PROMPT
    if reasoning or content:
        messages = [
            *PROMPT,
            {"role": "assistant", "reasoning_content": reasoning, "content": content},
        ]
    request = {**body, "messages": messages, "stream": False}
    reply = httpx.post(f"{server_url}/v1/chat/completions", json=request, timeout=60).json()
    message = reply["choices"][0]["message"]
    return {"reasoning": message.get("reasoning_content") or "", "content": message["content"]}


def after_echo(text: str, prefill: str) -> str:
    return text[len(prefill) :] if text.startswith(prefill) else text


@pytest.mark.parametrize("cut_after", [3, 15, 30])
def test_reasoning_cut_midway_goes_on_and_the_content_follows_in_its_field(
    thinkers, cut_after: int
) -> None:
    """Same model both sides: the fallback reasons on from the cut, closes the reasoning
    where the primary would have, and its answer arrives as content: field for field the
    uninterrupted answer."""
    first, _, proxy, body = thinkers
    whole = answer(first.url, body(LONG_THOUGHT))
    on_chunk = handoff_after(proxy, cut_after, hold=first)
    stream = read_stream(proxy.url, body(LONG_THOUGHT), on_chunk=on_chunk)
    assert_one_clean_stream(stream)
    assert "replayed as text" in stream.notes[0]
    assert stream.segments[0] == "" and stream.thoughts[0], "cut while the primary reasoned"
    assert "".join(stream.thoughts) == whole["reasoning"]
    assert stream.text == whole["content"] and stream.segments[1]
    assert sum(stream.segment_tokens) == ANSWER - 1  # </think> was a token, without a delta


def test_content_after_reasoning_goes_on_without_restating_the_reasoning(thinkers) -> None:
    first, second, proxy, body = thinkers
    request = body(SHORT_THOUGHT)
    whole = answer(first.url, request)
    thinking = read_stream(first.url, request)
    reasoning_tokens = sum(
        1 for c in thinking.chunks if c["choices"][0]["delta"].get("reasoning_content")
    )
    on_chunk = handoff_after(proxy, reasoning_tokens + 4, hold=first)
    stream = read_stream(proxy.url, request, on_chunk=on_chunk)
    assert_one_clean_stream(stream)
    assert stream.thoughts == [whole["reasoning"], ""]  # all from the primary, said once
    said = stream.segments[0]
    assert said and whole["content"].startswith(said)
    left = ANSWER - stream.segment_tokens[0] - 1  # and the </think> token
    rest = answer(second.url, {**request, "max_tokens": left}, whole["reasoning"], said)
    assert stream.segments[1] == after_echo(rest["content"], said) and stream.segments[1]
    assert sum(stream.segment_tokens) == ANSWER - 1  # </think> was a token, without a delta
