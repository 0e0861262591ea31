"""A request that holds an image: after a cut the next server must see the picture too.

Real llama-servers with `--mmproj` (the tiny primary and a tiny vision projector,
scripts/testbed/tinyvision.py: llama.cpp's own mtmd code encodes the picture) behind a
real proxy. Their `/apply-template` writes each picture as a marker that the native
`/completion` would read as plain text, so neither the answer's token ids nor a text
completion may carry such an answer: it goes on by the chat route, which reads the
picture again, or ends in-band saying why. The leg choice itself, for the engines not
run here, is checked on stand-in terms.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from addon.formats.transcript import Transcript
from addon.handoff import media
from addon.handoff.builder import Answer, CannotContinue, Leg, Prompt, build
from scripts.testbed.llamacppfiles import templates
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.mitm import Mitmdump
from scripts.testbed.tinyvision import ensure_projector, picture
from tests.streams import assert_one_clean_stream, read_stream
from tests.test_leg_fields import QWEN3
from tests.test_splice import handoff
from tests.throttle import Throttled

ANSWER = 40
LONG = 300  # killed at CUT, its server has more to write than a loaded client reads
CUT = 8
SAME_BATCHES = ["--ubatch-size", "32"]  # see test_exact_replay.py


def asked(tokens: int = ANSWER) -> dict[str, Any]:
    parts = [{"type": "text", "text": "What is in this picture?"},
             {"type": "image_url", "image_url": {"url": picture()}}]  # fmt: skip
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": tokens,
            "temperature": 0, "stream": True}  # fmt: skip


def vision_pair(
    models: dict[str, Path],
    start_server: Callable[..., LlamaServer],
    start_proxy: Callable[..., Mitmdump],
    *args: str,
) -> tuple[LlamaServer, LlamaServer, Mitmdump]:
    """Two servers of the tiny primary with the tiny projector (one vision model, one
    vocabulary: the answer's ids could be replayed), behind a proxy that knows them."""
    seeing = ["--mmproj", str(ensure_projector(models["primary"].parent)), *SAME_BATCHES, *args]
    first = start_server("primary", extra_args=seeing)
    second = start_server("primary", extra_args=seeing)
    proxy = start_proxy(first.url, [second.url])
    proxy.servers_known()
    return first, second, proxy


def chat_after(server: LlamaServer, body: dict[str, Any], before: str, left: int) -> str:
    """What `server`'s chat route writes after the answer `before`, asked directly to
    continue it (handoff/placing.py; a whole message repeats `before` first)."""
    trailing = [*body["messages"], {"role": "assistant", "content": before}]
    request = {**body, "messages": trailing, "max_tokens": left, "stream": False,
               "continue_final_message": "content", "add_generation_prompt": False,
               "cache_prompt": False}  # fmt: skip
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=request, timeout=60)
    content = reply.json()["choices"][0]["message"]["content"]
    assert content.startswith(before), content
    return content.removeprefix(before)


def test_an_answer_about_an_image_goes_on_where_the_next_server_sees_it(
    models: dict[str, Path],
    start_server: Callable[..., LlamaServer],
    start_proxy: Callable[..., Mitmdump],
) -> None:
    """A handoff mid-answer: the fallback goes on by its chat route, exactly as it
    continues the answer with the picture asked directly; a continuation of the marker
    as text (what the ids leg read) writes something else."""
    first, second, proxy = vision_pair(models, start_server, start_proxy)
    body = asked()
    # Throttled, as on a slow card: the cut lands near the client's CUT-th chunk, before
    # the answer writes its opening words again. (A continuation that starts with them
    # loses them today: the proxy strips an echo of the answer from a leg whose
    # `continue_final_message` llama-server does not echo.)
    with Throttled(first.pid) as slowed:

        def cut(n: int) -> None:
            if n == CUT:
                with slowed.held():
                    handoff(proxy, reason="test pressure")

        stream = read_stream(proxy.url, body, on_chunk=cut)
    assert_one_clean_stream(stream)
    assert "replayed as text" in stream.notes[0], stream.notes
    before, after = stream.segments
    left = ANSWER - stream.segment_tokens[0]
    assert after == chat_after(second, body, before, left)
    # The proof can fail: without the picture the same server writes something else.
    rendered = httpx.post(f"{second.url}/apply-template", json=body).json()["prompt"]
    assert media.MARKER.search(rendered), rendered
    native = {"prompt": rendered + before, "n_predict": left, "temperature": 0}
    blind = httpx.post(f"{second.url}/completion", json=native, timeout=60).json()["content"]
    assert blind != after


def test_an_answer_about_an_image_is_not_continued_as_a_text_completion(
    models: dict[str, Path],
    start_server: Callable[..., LlamaServer],
    start_proxy: Callable[..., Mitmdump],
) -> None:
    """Qwen3's template opens a reasoning block in a trailing message, so a plain answer
    would go on as a text completion on the native /completion (the client's own
    `timings_per_token` keeps the ids unasked): with a picture in the request it ends
    in-band with the reason instead."""
    qwen3 = {t.stem: t for t in templates()}[QWEN3]
    served = ["--jinja", "--chat-template-file", str(qwen3)]
    first, _, proxy = vision_pair(models, start_server, start_proxy, *served)
    body = {**asked(LONG), "timings_per_token": True}
    stream = read_stream(proxy.url, body, on_chunk=lambda n: n == CUT and first.kill())
    (error,) = stream.errors
    message = error["error"]["message"]
    assert media.refusal("an image") in message, message
    assert stream.segments[0] and not stream.segments[-1], stream.segments


def test_a_fallback_without_a_projector_says_it_sees_no_image(
    models: dict[str, Path],
    start_server: Callable[..., LlamaServer],
    start_proxy: Callable[..., Mitmdump],
) -> None:
    """The fallback runs the same model without `--mmproj`: it cannot render the request
    at all, and the answer ends in-band with its own words."""
    projector = ensure_projector(models["primary"].parent)
    first = start_server("primary", extra_args=["--mmproj", str(projector)])
    second = start_server("primary")
    proxy = start_proxy(first.url, [second.url])
    proxy.servers_known()
    stream = read_stream(proxy.url, asked(LONG), on_chunk=lambda n: n == CUT and first.kill())
    (error,) = stream.errors
    message = error["error"]["message"]
    assert "image input is not supported" in message and second.url in message, message


class StandIn:
    """An engine's terms that offer every leg: ids, parsed ids, text; its chat route
    reads a trailing message as the truth where `reads_truth`."""

    url = "http://stand-in"

    def __init__(self, rendering: str = "<prompt>", reads_truth: bool = False) -> None:
        self._rendering = rendering
        self._reads_truth = reads_truth

    async def saw(self) -> Prompt:
        return Prompt(text=self._rendering)

    async def truth(self, saw: Prompt, written: str) -> Prompt:
        return Prompt(text=(saw.text or "") + written)

    async def spelled(self, text: str) -> str | None:
        return None

    async def reads(self, chat: dict[str, Any]) -> Prompt:
        return Prompt(text="<truth>" if self._reads_truth else "<other>")

    def parting(self, read: Prompt, truth: Prompt) -> str | None:
        return None if read.text == "<truth>" else "they part"

    def text_leg(self, truth: Prompt) -> Leg:
        return "/text", {}, None

    def ids_leg(self, saw: Prompt, ids: list[int]) -> Leg:
        return "/ids", {}, None

    def parsed_leg(self, truth: Prompt) -> Leg:
        return "/parsed", {}, None


PARTS = {
    "an image": {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
    "audio": {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}},
    "a content part of type 'document'": {"type": "document"},
}


def leg_for(terms: StandIn, messages: list[dict[str, Any]]) -> tuple[str, str]:
    chat = {"messages": [*messages, {"role": "assistant", "content": "It shows"}]}
    chat_leg = lambda body: ("/chat", body, None)  # noqa: E731
    answer = Answer(Transcript(content=["It shows"]), "", chat, False, chat_leg)
    (path, _, _), replay = asyncio.run(build(terms, answer, [1, 2]))
    return path, replay


@pytest.mark.parametrize("what", PARTS)
def test_media_goes_only_by_a_chat_route(what: str) -> None:
    """Ids, parsed ids and text are each offered; with media in the messages only the
    chat route that reads the truth is taken, else the answer ends with the reason."""
    plain = [{"role": "user", "content": [{"type": "text", "text": "Look."}]}]
    pictured = [{"role": "user", "content": [plain[0]["content"][0], PARTS[what]]}]
    assert leg_for(StandIn(), plain) == ("/ids", "token ids")
    assert leg_for(StandIn(reads_truth=True), pictured) == ("/chat", "text")
    with pytest.raises(CannotContinue, match=media.refusal(what)):
        leg_for(StandIn(), pictured)


def test_a_rendering_with_llama_server_s_marker_counts_as_media() -> None:
    """A text-only request whose rendering holds the marker (mtmd's default, or the
    server's random one) takes no leg of ids or text either."""
    plain = [{"role": "user", "content": "Look."}]
    for marker in ("<__media__>", "<__media_bPbw00WZsvLd6c5yKztaNd5nuYDIpx4L__>"):
        with pytest.raises(CannotContinue, match="media marker is in its rendering"):
            leg_for(StandIn(rendering=f"user: Look.{marker}\n"), plain)
