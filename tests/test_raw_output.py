"""What the model wrote, byte for byte, whatever the primary's parser showed the client:
real chat templates of llama.cpp (`--jinja --chat-template-file`) on real llama-servers
behind a real proxy, an answer cut mid-stream, and what the client gets after the cut
compared with the fallback's own continuation of the truth, asked of it directly (its
rendering of the original request, then the primary's raw output up to the cut, on its
native /completion).

The raw output is read here as the engine gives it: each token's bytes, asked on the
chat route with llama.cpp's `n_probs` (accepted with tools in a stream, where `logprobs`
is refused).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from itertools import islice
from typing import Any, NamedTuple

import httpx
import pytest

from scripts.testbed.llamacppfiles import templates
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.mitm import Mitmdump
from tests.chat_shapes import SHAPES
from tests.streams import RawStream, assert_one_clean_stream, read_stream
from tests.test_splice import handoff
from tests.throttle import Throttled

ANSWER = 40
CUT = 12
SAME_BATCHES = ["--ubatch-size", "32"]  # see test_exact_replay.py
NEMO = "mistralai-Mistral-Nemo-Instruct-2407"
QWEN35 = "Qwen3.5-4B"
R1 = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"


class Piece(NamedTuple):
    id: int
    bytes: bytes


def pieces(server: LlamaServer, body: dict[str, Any]) -> list[Piece]:
    """Each generated token, in order, as the server itself gives it."""
    asked = {**body, "n_probs": 1, "post_sampling_probs": True}
    found: list[Piece] = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=asked, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    for entry in (choice.get("logprobs") or {}).get("content") or ():
                        found.append(Piece(entry["id"], bytes(entry["bytes"])))
    return found


def text_of(wrote: list[Piece]) -> str:
    return b"".join(piece.bytes for piece in wrote).decode()


def truth(server: LlamaServer, body: dict[str, Any], wrote: list[Piece], note: str) -> list:
    """`server`'s rendering of `body`, then what the model wrote, the way the handoff
    note says the proxy replayed it: as token ids, or else as text, which `server`
    tokenizes its own way (a tiny random model often writes a word in other pieces)."""
    if "replayed as token ids" in note:
        return [rendered(server, body), *(piece.id for piece in wrote)]
    return [rendered(server, body) + text_of(wrote)]


def continued(server: LlamaServer, prompt: list, count: int) -> list[Piece]:
    """What `server` writes after `prompt` (text and token ids), asked directly."""
    body = {"prompt": prompt, "n_predict": count, "temperature": 0, "cache_prompt": False,
            "n_probs": 1, "post_sampling_probs": True}  # fmt: skip
    reply = httpx.post(f"{server.url}/completion", json=body, timeout=60).json()
    return [Piece(e["id"], bytes(e["bytes"])) for e in reply["completion_probabilities"]]


def own_continuation(
    server: LlamaServer, body: dict[str, Any], wrote: list[Piece], note: str, left: int
) -> str:
    """What `server` writes after its rendering of `body` and `wrote`, asked directly."""
    return text_of(continued(server, truth(server, body, wrote, note), left))


def read_cut(
    proxy: Mitmdump, body: dict[str, Any], slowed: list[LlamaServer], at: tuple[int, ...],
    **pace: float,
) -> RawStream:  # fmt: skip
    """The answer to `body` through `proxy`, a handoff asked as the client gets each chunk
    numbered in `at` (the first holds the role alone), the `slowed` servers throttled as on
    a slow card: run free, a tiny model writes the whole answer before a loaded machine's
    client reaches the chunk that cuts it. The i-th cut is of the i-th of `slowed`, held
    while it is asked (the next one is not: it is asked before the cut)."""
    with ExitStack() as stack:
        throttles = [stack.enter_context(Throttled(server.pid, **pace)) for server in slowed]

        def on_chunk(n: int) -> None:
            if n in at:
                with throttles[at.index(n)].held():
                    handoff(proxy, reason="test pressure")

        return read_stream(proxy.url, body, on_chunk=on_chunk)


@pytest.fixture
def pair(
    start_server: Callable[..., LlamaServer], start_proxy: Callable[..., Mitmdump]
) -> Callable[[str], tuple[LlamaServer, LlamaServer, Mitmdump]]:
    by_name = {template.stem: template for template in templates()}

    def start(template: str) -> tuple[LlamaServer, LlamaServer, Mitmdump]:
        args = ["--jinja", "--chat-template-file", str(by_name[template]), *SAME_BATCHES]
        first = start_server("primary", extra_args=args)
        second = start_server("fallback", extra_args=args)
        return first, second, start_proxy(first.url, [second.url])

    return start


CASES = [
    (NEMO, "tools offered", "content"),  # the tool-call parser trims the leading space
    (QWEN35, "plain", "reasoning"),  # the reasoning parser trims it after <think>\n
    (QWEN35, "content parts", "reasoning"),
    (R1, "plain", "reasoning"),  # cut while the reasoning is still open
]


@pytest.mark.parametrize(("template", "shape", "field"), CASES)
def test_the_fallback_goes_on_from_what_the_model_wrote(
    pair: Callable[[str], tuple[LlamaServer, LlamaServer, Mitmdump]],
    template: str,
    shape: str,
    field: str,
) -> None:
    first, second, proxy = pair(template)
    body = {**SHAPES[shape], "max_tokens": ANSWER, "stream": True, "temperature": 0}
    wrote = pieces(first, body)
    stream = read_cut(proxy, body, [first], (CUT,))
    assert_one_clean_stream(stream)
    assert len(stream.notes) == 1 and "handoff" in stream.notes[0], stream.notes
    said = stream.segment_tokens[0]
    before = stream.thoughts[0] if field == "reasoning" else stream.segments[0]
    assert text_of(wrote[:said]).lstrip() == before.lstrip()
    expected = own_continuation(second, body, wrote[:said], stream.notes[0], ANSWER - said)
    after = {"reasoning": stream.thoughts[1], "content": stream.segments[1]}
    assert after.pop(field) == expected and expected
    assert list(after.values()) == [""], "the rest stays in the field it was in"


def test_a_continuation_that_opens_like_the_answer_keeps_its_words(
    start_server: Callable[..., LlamaServer], start_proxy: Callable[..., Mitmdump]
) -> None:
    """The fallback's continuation is asked as a placed message (`continue_final_message`),
    which llama-server does not send back first, though it repeats a plain trailing
    message: cut where the fallback's own next piece is how the answer began, that piece
    is the continuation's, not an echo to take out. Cuts are asked where that holds (the
    primary throttled); each is compared. The fallback's vocabulary is not the primary's,
    so the answer goes as text. A loaded machine's client can read the cut's chunk after
    the throttled primary wrote one more, so cuts are asked until one lands there (at
    most ATTEMPTS), each compared."""
    template = {t.stem: t for t in templates()}[NEMO]
    args = ["--jinja", "--chat-template-file", str(template), *SAME_BATCHES]
    first = start_server("primary", extra_args=args)
    second = start_server("turns-fallback", extra_args=args)
    proxy = start_proxy(first.url, [second.url])
    found = (
        (body, wrote, cut)
        for body, wrote in _answers(first)
        for cut in range(6, LONGER - 10)
        if _opens_like(second, body, wrote[:cut])
    )
    asked = 0
    for body, wrote, cut in islice(found, ATTEMPTS):
        asked += 1
        stream = read_cut(proxy, body, [first], (cut + 1,), run_s=0.0003, period_s=0.03)
        assert_one_clean_stream(stream)
        said = stream.segment_tokens[0]
        assert "replayed as text" in stream.notes[0], stream.notes
        expected = own_continuation(second, body, wrote[:said], stream.notes[0], LONGER - said)
        assert stream.segments[1] == expected and expected
        if _opens_like(second, body, wrote[:said]):
            return
    assert asked, "no cut where the fallback goes on as the answer began"
    raise AssertionError(f"none of {asked} cuts landed where the fallback goes on as it began")


ATTEMPTS = 6


LONGER = 80


def _answers(server: LlamaServer) -> Iterator[tuple[dict[str, Any], list[Piece]]]:
    for shape in ("plain", "system", "multi-turn", "content parts"):
        body = {**SHAPES[shape], "max_tokens": LONGER, "stream": True, "temperature": 0}
        yield body, pieces(server, body)


def _opens_like(server: LlamaServer, body: dict[str, Any], wrote: list[Piece]) -> bool:
    """Whether `server`'s own next piece after `wrote` is how `wrote` began."""
    text = text_of(continued(server, truth(server, body, wrote, ""), 1))
    return bool(text) and text_of(wrote).startswith(text)


def test_the_chat_route_gives_each_token_with_tools_in_a_stream(
    pair: Callable[[str], tuple[LlamaServer, LlamaServer, Mitmdump]],
) -> None:
    """llama-server refuses `logprobs` with tools in a stream, takes `n_probs`, and takes
    `return_tokens` on its chat route without ever sending the ids there (only its native
    /completion does): so the pieces are asked as `n_probs`."""
    first, _, _ = pair(NEMO)
    body = {**SHAPES["tools offered"], "max_tokens": 4, "stream": True, "temperature": 0}
    url = f"{first.url}/v1/chat/completions"
    assert httpx.post(url, json={**body, "logprobs": True}).status_code == 400
    assert len(pieces(first, body)) == 4
    returned = httpx.post(url, json={**body, "return_tokens": True}).text
    assert '"tokens"' not in returned and "logprobs" not in returned


# Templates whose chat route cannot be asked to read what the model saw and wrote: a
# trailing message opens a reasoning block the model never wrote (Qwen3, SmolLM3,
# Granite 3.3), or renders the turn's end over again (Phi-3.5); with tools offered the
# text route would hand a tool call to the client as text.
NO_TOOLS_ROUTE = [
    "Qwen-Qwen3-0.6B",
    "HuggingFaceTB-SmolLM3-3B",
    "ibm-granite-granite-3.3-2B-Instruct",
    "microsoft-Phi-3.5-mini-instruct",
]


@pytest.mark.parametrize("template", NO_TOOLS_ROUTE)
def test_tools_offered_where_no_route_reads_the_truth_end_in_band_with_the_reason(
    pair: Callable[[str], tuple[LlamaServer, LlamaServer, Mitmdump]], template: str
) -> None:
    """The primary is killed mid-answer (a pressure handoff that cannot go anywhere leaves
    the answer where it is)."""
    first, _, proxy = pair(template)
    body = {**SHAPES["tools offered"], "max_tokens": 300, "stream": True, "temperature": 0}
    stream = read_stream(proxy.url, body, on_chunk=lambda n: n == CUT and first.kill())
    (error,) = stream.errors
    message = error["error"]["message"]
    assert "the model saw" in message and "would not read tool calls" in message, message
    assert stream.segments[0] and stream.done == 0


def rendered(server: LlamaServer, body: dict[str, Any]) -> str:
    request = {k: v for k, v in body.items() if k != "stream"}
    return httpx.post(f"{server.url}/apply-template", json=request).json()["prompt"]


def test_what_the_model_wrote_stays_known_after_the_first_handoff(
    start_server: Callable[..., LlamaServer], start_proxy: Callable[..., Mitmdump]
) -> None:
    """Qwen 3.5, its reasoning still open: cut on the primary, cut again on the first
    fallback. The second fallback reads the primary's raw output and the first
    fallback's, byte for byte (the delivered reasoning lacks the space the parser
    trimmed after `<think>\\n`)."""
    template = {t.stem: t for t in templates()}[QWEN35]
    args = ["--jinja", "--chat-template-file", str(template), *SAME_BATCHES]
    first, middle, last = (
        start_server(m, extra_args=args) for m in ("primary", "fallback", "fallback")
    )
    proxy = start_proxy(first.url, [middle.url, last.url])
    proxy.servers_known()
    body = {**SHAPES["plain"], "max_tokens": ANSWER, "stream": True, "temperature": 0}
    wrote = pieces(first, body)
    # Slower than read_cut's default: in a loaded run the first fallback once wrote the
    # rest of its answer before the client reached the second cut's chunk.
    stream = read_cut(proxy, body, [first, middle], (CUT, 2 * CUT), run_s=0.001, period_s=0.03)
    assert_one_clean_stream(stream)
    assert len(stream.notes) == 2, stream.notes
    said, then = stream.segment_tokens[:2]
    raw = wrote[:said]
    raw += continued(middle, truth(middle, body, raw, stream.notes[0]), then)
    assert stream.thoughts[0] + stream.thoughts[1] != text_of(raw)
    assert not "".join(stream.segments)
    expected = own_continuation(last, body, raw, stream.notes[1], ANSWER - said - then)
    assert stream.thoughts[2] == expected and expected


CLOSE = "</think>"


def test_an_answer_past_qwen35s_reasoning_ends_in_band_where_its_closing_tag_was_hidden(
    pair: Callable[[str], tuple[LlamaServer, LlamaServer, Mitmdump]],
) -> None:
    """Qwen 3.5's template on real llama-servers, the model pushed to close its reasoning
    early (a logit bias on </think>) and killed once its content began. Its parser hid
    the tag, and the whitespace around it, from every chunk (a count of the tokens, no
    ids): the template writes "\\n</think>\\n\\n" there, the model did not, and the
    answer ends in-band saying what is not known (it went on from the template's)."""
    first, second, proxy = pair(QWEN35)
    close = httpx.post(f"{first.url}/tokenize", json={"content": CLOSE}).json()["tokens"]
    body = {**SHAPES["plain"], "max_tokens": ANSWER, "stream": True, "temperature": 0}
    for push in (8.0, 12.0, 16.0, 20.0):
        body["logit_bias"] = [[close[0], push]]
        said = [(c["delta"].get("reasoning_content"), c["delta"].get("content"))
                for c in _choices(first, body)]  # fmt: skip
        reasoned = sum(1 for thought, _ in said if thought)
        if reasoned and sum(1 for _, text in said if text) >= 8:
            break
    else:
        pytest.fail("no push on </think> gave reasoning, then 8 chunks of content")
    native = {"prompt": rendered(first, body), "n_predict": ANSWER, "temperature": 0,
              "logit_bias": body["logit_bias"]}  # fmt: skip
    raw = httpx.post(f"{first.url}/completion", json=native, timeout=60).json()["content"]
    assert CLOSE in raw and f"\n{CLOSE}\n\n" not in raw, raw
    thought = {"role": "assistant", "reasoning_content": "r", "content": "c"}
    template = rendered(second, {**body, "messages": [*body["messages"], thought]})
    assert f"r\n{CLOSE}\n\nc" in template, template
    with Throttled(first.pid):
        stream = read_stream(proxy.url, body, on_chunk=lambda n: n == reasoned + 4 and first.kill())
    (error,) = stream.errors
    assert "closed its reasoning with tokens the client never saw" in error["error"]["message"]
    assert stream.done == 0 and stream.thoughts[0] and stream.segments[0]
    assert not "".join(stream.segments[1:] + stream.thoughts[1:]), "nothing after the cut"


def _choices(server: LlamaServer, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The choices of `server`'s own streamed answer to `body`."""
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                yield from json.loads(line[6:])["choices"]
