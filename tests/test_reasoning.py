"""Reasoning answers: the reasoning goes on on the fallback, and what follows it stays in
the content field. Both servers use the tiny models' reasoning template (the answer opens
in a <think> phase); a logit_bias on </think> makes the models close it after a while.

How long the model reasons under a given push depends on the last bits of its logits, and
so on the CPU kernels llama-server was built with: the push (and, where no push fits, the
question) is calibrated against the servers in use, once per module."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import permutations
from pathlib import Path
from typing import Any

import httpx
import pytest

from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.mitm import Mitmdump
from scripts.testbed.tinymodels import reasoning_template
from tests.streams import PROMPT, assert_one_clean_stream, chat_body, read_stream
from tests.test_raw_output import pieces, rendered, text_of
from tests.test_splice import handoff_after
from tests.throttle import Throttled

ANSWER = 240
CUTS = [3, 15, 30]
SAME_BATCHES = ["--ubatch-size", "32"]  # see test_exact_replay.py


@dataclass(frozen=True)
class Shape:
    """What a test needs of the primary's own answer: `least` to `most` chunks of
    reasoning, then content to the end of its ANSWER tokens."""

    name: str
    least: int
    most: int


# Reasons well past the latest cut, then answers for 20 tokens or more. The client's count
# of chunks lags the primary's: by a few tokens, by dozens on a busy machine.
LONG_THOUGHT = Shape("long reasoning", max(CUTS) + 70, ANSWER - 21)
# Reasons a little, then answers at length: room for a cut inside the content.
SHORT_THOUGHT = Shape("short reasoning", 3, 30)

# The answer closes its reasoning at the first token where the push lifts </think> above
# the model's own best token; everything before is the same greedy text whatever the push.
# So the reasoning shortens in steps as the push grows, and whether a step lands in a
# shape's range depends on the question: these are tried in turn.
SUBJECTS = ["river", "bridge", "stone", "garden", "market", "forest", "ocean", "valley"]
QUESTIONS = list(
    dict.fromkeys(
        [
            PROMPT[0]["content"],
            *(f"Tell me a story about the {a} and the {b}." for a, b in permutations(SUBJECTS, 2)),
        ]
    )
)[:24]
PUSHES = (0.0, 32.0)  # from never closing to closing at once, on the tiny models
RESOLUTION = 0.05
# A push this far from both edges of its step is not moved across one by the engine's
# batch variance (near-tie flips have been seen at gaps up to 0.06).
MARGIN = 0.15
CLOSE = "</think>"


@dataclass(frozen=True)
class Thought:
    """A request whose answer has the shape asked for, found on the server in use."""

    question: str
    push: float


class Calibration:
    """Finds, for each shape, a question and a push on </think> that give it on the
    server in use (greedy, so a few requests per question decide)."""

    def __init__(self) -> None:
        # A new connection for each request: on a busy machine a kept-alive one was now and
        # then closed by llama-server as the next request went out on it.
        self.client = httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0))
        self.found: dict[Shape, Thought | str] = {}
        self.url = ""
        self.close = -1  # the </think> token

    def thought(self, server_url: str, shape: Shape) -> Thought:
        """Calibrated on the first server asked about: every server here runs the same
        build, model and arguments, so it answers for all."""
        if shape not in self.found:
            self.url = server_url
            close = self.client.post(f"{server_url}/tokenize", json={"content": "</think>"})
            (self.close,) = close.json()["tokens"]
            self.found[shape] = self.search(shape)
        found = self.found[shape]
        if isinstance(found, str):
            pytest.fail(found, pytrace=False)
        return found

    def body(self, question: str, push: float) -> dict[str, Any]:
        return chat_body(
            ANSWER,
            messages=[{"role": "user", "content": question}],
            logit_bias={str(self.close): push},
        )

    def deltas(self, question: str, push: float) -> Iterator[dict[str, Any]]:
        url = f"{self.url}/v1/chat/completions"
        with self.client.stream("POST", url, json=self.body(question, push)) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        yield choice.get("delta", {})

    def reasoning(self, question: str, push: float, most: int) -> int:
        """Chunks of reasoning before the content starts, counted up to `most` + 1 (the
        stream is dropped there, or at the first content)."""
        count = 0
        deltas = self.deltas(question, push)
        for delta in deltas:
            if delta.get("content") or count > most:
                break
            count += bool(delta.get("reasoning_content"))
        deltas.close()
        return count

    def whole(self, question: str, push: float) -> tuple[list[str], list[str]]:
        """The whole answer: its reasoning deltas, its content deltas."""
        deltas = list(self.deltas(question, push))
        return (
            [d["reasoning_content"] for d in deltas if d.get("reasoning_content")],
            [d["content"] for d in deltas if d.get("content")],
        )

    def search(self, shape: Shape) -> Thought | str:
        tried = []
        for question in QUESTIONS:
            found = self.search_question(shape, question)
            if isinstance(found, Thought):
                return found
            tried.append(f"  {question!r}: {found}")
        return (
            f"calibration: no push on </think> (token {self.close}) in {PUSHES[0]}..{PUSHES[1]} "
            f"made the primary reason for {shape.least}..{shape.most} chunks and then answer "
            f"in content to the end of its {ANSWER} tokens, the whole answer the same within "
            f"{MARGIN} of the push, for any of {len(QUESTIONS)} questions. Chunks of reasoning "
            "seen, at the pushes that gave them:\n" + "\n".join(tried)
        )

    def search_question(self, shape: Shape, question: str) -> Thought | str:
        """The thought found for `question`, or what was seen instead."""
        seen: dict[float, int] = {}

        def reasoning_at(push: float) -> int:
            if push not in seen:
                seen[push] = self.reasoning(question, push, shape.most)
            return seen[push]

        # The reasoning shortens as the push grows: bisect for a push inside the range...
        low, high = PUSHES
        middle = (low + high) / 2
        while not shape.least <= reasoning_at(middle) <= shape.most:
            if reasoning_at(middle) > shape.most:
                low = middle
            else:
                high = middle
            if high - low < RESOLUTION:
                return steps(seen, shape.most)
            middle = (low + high) / 2
        # ...then for the edges of its step, to push from the middle of it.
        reasoning = reasoning_at(middle)
        edges = []
        for outside in (low, high):
            inside = middle
            while abs(outside - inside) > RESOLUTION:
                probe = (outside + inside) / 2
                if reasoning_at(probe) == reasoning:
                    inside = probe
                else:
                    outside = probe
            edges.append(inside)
        start, end = edges
        push = (start + end) / 2
        if end - push < MARGIN:
            return f"{steps(seen, shape.most)} (step too narrow)"
        # The answer must not change anywhere near the push, in its content either (a
        # near-tie with </think> there would flip as easily).
        thoughts, content = self.whole(question, push)
        for nearby in (push - MARGIN, push + MARGIN):
            if self.whole(question, nearby) != (thoughts, content):
                return f"{steps(seen, shape.most)}; the answer at {nearby:.2f} differs"
        if (len(thoughts), len(content)) != (reasoning, ANSWER - 1 - reasoning):
            return (
                f"{steps(seen, shape.most)}; the whole answer at {push:.2f} has "
                f"{len(thoughts)} chunks of reasoning and {len(content)} of content"
            )
        return Thought(question, push)


def steps(seen: dict[float, int], most: int) -> str:
    """ "r at a..b, ..." for the chunks of reasoning seen, by push."""
    runs: list[tuple[str, float, float]] = []
    for push, count in sorted(seen.items()):
        said = f">{most}" if count > most else str(count)
        if runs and runs[-1][0] == said:
            runs[-1] = (said, runs[-1][1], push)
        else:
            runs.append((said, push, push))
    return ", ".join(f"{r} at {a:.2f}..{b:.2f}" for r, a, b in runs)


@pytest.fixture(scope="module")
def calibration() -> Iterator[Calibration]:
    calibration = Calibration()
    yield calibration
    calibration.client.close()


@dataclass
class Thinkers:
    first: LlamaServer
    second: LlamaServer
    proxy: Mitmdump
    body: Callable[[Shape], dict[str, Any]]


@pytest.fixture
def thinkers(
    models: dict[str, Path],
    start_server: Callable[..., LlamaServer],
    start_proxy: Callable[..., Mitmdump],
    calibration: Calibration,
) -> Thinkers:
    """Two servers with the same model and the reasoning template, the second as the
    first's fallback."""
    template = str(reasoning_template(models["primary"].parent))
    args = ["--chat-template-file", template, *SAME_BATCHES]
    first, second = (
        start_server("primary", extra_args=args),
        start_server("primary", extra_args=args),
    )
    proxy = start_proxy(first.url, [second.url])

    def body(shape: Shape) -> dict[str, Any]:
        thought = calibration.thought(first.url, shape)
        return calibration.body(thought.question, thought.push)

    return Thinkers(first, second, proxy, body)


@pytest.mark.parametrize("cut_after", CUTS)
def test_reasoning_cut_midway_goes_on_and_the_content_follows_in_its_field(
    thinkers: Thinkers, cut_after: int
) -> None:
    """Same model both sides: the fallback reasons on from what the primary wrote up to the
    cut, closes the reasoning where its own continuation of that text does, and its answer
    arrives as content. (Not compared with the uninterrupted answer: replayed as text, the
    words are read in the fallback's own pieces, which a tiny random model can follow
    differently at a near tie.)"""
    first, second = thinkers.first, thinkers.second
    request = thinkers.body(LONG_THOUGHT)
    wrote = pieces(first, {**request, "stream": True})
    on_chunk = handoff_after(thinkers.proxy, cut_after, hold=first)
    stream = read_stream(thinkers.proxy.url, request, on_chunk=on_chunk)
    assert_one_clean_stream(stream)
    assert "replayed as text" in stream.notes[0]
    assert stream.segments[0] == "" and stream.thoughts[0], "cut while the primary reasoned"
    said = stream.segment_tokens[0]
    assert stream.thoughts[0] == text_of(wrote[:said])
    saw = rendered(second, request) + text_of(wrote[:said])
    native = {"prompt": saw, "n_predict": ANSWER - said, "temperature": 0,
              "cache_prompt": False, "logit_bias": request["logit_bias"]}  # fmt: skip
    own = httpx.post(f"{second.url}/completion", json=native, timeout=60).json()["content"]
    reasoning, closed, content = own.partition(CLOSE)
    assert closed and content, f"the fallback's own continuation never answers: {own!r}"
    assert stream.thoughts[1] == reasoning and stream.segments[1] == content
    assert sum(stream.segment_tokens) == ANSWER - 1  # </think> was a token, without a delta


def test_an_answer_past_its_reasoning_ends_in_band_where_its_closing_tag_was_hidden(
    thinkers: Thinkers,
) -> None:
    """Killed once its content began: the tag that closed the reasoning came in no chunk
    (the parser hid it; llama-server's chat stream sends no ids for it), and the model
    wrote it without the whitespace the template writes around it, so no trailing message
    reads what the model wrote. The answer ends in-band saying so (it went on from the
    template's "\n</think>\n\n" before)."""
    first, second, proxy = thinkers.first, thinkers.second, thinkers.proxy
    request = thinkers.body(SHORT_THOUGHT)
    thinking = read_stream(first.url, request)
    reasoning_tokens = sum(
        1 for c in thinking.chunks if c["choices"][0]["delta"].get("reasoning_content")
    )
    native = {"prompt": rendered(first, request), "n_predict": reasoning_tokens + 3,
              "temperature": 0, "logit_bias": request["logit_bias"]}  # fmt: skip
    raw = httpx.post(f"{first.url}/completion", json=native, timeout=60).json()["content"]
    closing = raw.partition(CLOSE)
    template = {**request, "messages": [*request["messages"], {
        "role": "assistant", "reasoning_content": closing[0].strip(), "content": "x"}]}  # fmt: skip
    assert CLOSE in raw and f"\n{CLOSE}\n\n" in rendered(second, template)
    assert f"\n{CLOSE}\n\n" not in raw, "the model writes the template's whitespace"
    with Throttled(first.pid):
        kill = lambda n: n == reasoning_tokens + 4 and first.kill()  # noqa: E731
        stream = read_stream(proxy.url, request, on_chunk=kill)
    (error,) = stream.errors
    assert "closed its reasoning with tokens the client never saw" in error["error"]["message"]
    assert stream.done == 0 and stream.thoughts[0] and stream.segments[0]
    assert not "".join(stream.segments[1:] + stream.thoughts[1:]), "nothing after the cut"
