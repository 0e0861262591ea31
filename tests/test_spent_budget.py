"""An answer that has written all its `max_tokens` has nothing left to continue: a handoff
decided while its last token arrives leaves it where it is, and it ends as its server
ends it (finish_reason "length"), never with a continuation asked to write one more.

The primary here is a stand-in (scripts/testbed/scripted_upstream.py) for what no real
server does on demand: it sends the answer's last token and holds its finish chunk back
for seconds. Each token comes with its logprobs, as llama-server sends them when the
client asks. The fallback is a real llama-server: the one that wrote a 1,497th token for
a limit of 1,496 when it was asked to go on (issue 54).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.mitm import Mitmdump
from scripts.testbed.prompts import chat_body
from scripts.testbed.scripted_upstream import STREAM_HEAD, FakeUpstream, chunked
from tests.streams import RawStream, read_stream
from tests.test_splice import handoff

LIMIT = 6
WORDS = [" the", " quiet", " river", " runs", " north", " again"]
LAST_TOKEN_S = 1.0  # after the first LIMIT - 1 tokens, the last comes
FINISH_S = 4.0  # and its finish chunk after that
ASKING_S = 2.0  # the fallback held while the handoff is decided: past the last token


def token_chunk(word: str, token: int) -> bytes:
    """A chat chunk of one token with its logprobs, as llama-server streams it."""
    entry = {"id": token, "token": word, "logprob": -0.5, "bytes": list(word.encode()),
             "top_logprobs": []}  # fmt: skip
    choice = {"index": 0, "delta": {"content": word}, "finish_reason": None,
              "logprobs": {"content": [entry]}}  # fmt: skip
    chunk = {"id": "chatcmpl-s", "created": 1, "model": "scripted",
             "object": "chat.completion.chunk", "choices": [choice]}  # fmt: skip
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def finish_chunk() -> bytes:
    choice = {"index": 0, "delta": {}, "finish_reason": "length"}
    chunk = {"id": "chatcmpl-s", "created": 1, "model": "scripted",
             "object": "chat.completion.chunk", "choices": [choice]}  # fmt: skip
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def role_chunk() -> bytes:
    choice = {"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}
    chunk = {"id": "chatcmpl-s", "created": 1, "model": "scripted",
             "object": "chat.completion.chunk", "choices": [choice]}  # fmt: skip
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


@pytest.fixture
def late_finish() -> Iterator[FakeUpstream]:
    """All but the last token, the last one a second later, and the finish long after."""
    words = [token_chunk(word, 500 + n) for n, word in enumerate(WORDS)]
    upstream = FakeUpstream([
        (STREAM_HEAD + chunked(role_chunk(), *words[:-1]), LAST_TOKEN_S),
        (chunked(words[-1]), FINISH_S),
        (chunked(finish_chunk(), b"data: [DONE]\n\n") + b"0\r\n\r\n", 0),
    ])  # fmt: skip
    yield upstream
    upstream.close()


@pytest.fixture
def no_finish() -> Iterator[FakeUpstream]:
    """Every token, then the connection closed before the finish chunk."""
    words = [token_chunk(word, 500 + n) for n, word in enumerate(WORDS)]
    upstream = FakeUpstream([(STREAM_HEAD + chunked(role_chunk(), *words), 0.2)])
    yield upstream
    upstream.close()


def content_tokens(stream: RawStream) -> int:
    return sum(1 for c in stream.chunks for ch in c["choices"] if ch["delta"].get("content"))


def test_a_handoff_decided_as_the_last_token_arrives_leaves_the_answer(
    late_finish: FakeUpstream,
    start_server: Callable[..., LlamaServer],
    start_proxy: Callable[..., Mitmdump],
) -> None:
    fallback = start_server("fallback")
    proxy = start_proxy(late_finish.url, [fallback.url])
    proxy.servers_known()
    body = chat_body(LIMIT, logprobs=True)
    asked: list[int] = []

    def on_chunk(n: int) -> None:
        if n != LIMIT:  # the role, then all but the last token
            return
        # The handoff asks the fallback what it must (its rendering of the request) while
        # the answer goes on; held, it answers only once the last token is in.
        os.kill(fallback.pid, signal.SIGSTOP)
        try:
            asking = threading.Thread(target=lambda: asked.append(handoff(proxy, reason="t")))
            asking.start()
            time.sleep(ASKING_S)
        finally:
            os.kill(fallback.pid, signal.SIGCONT)
        asking.join()

    stream = read_stream(proxy.url, body, on_chunk=on_chunk)
    assert asked == [0], "nothing was left to move"
    assert stream.notes == [] and stream.errors == []
    assert content_tokens(stream) == LIMIT
    assert stream.finishes == ["length"] and stream.done == 1


def test_a_server_lost_after_the_last_token_is_not_asked_to_go_on(
    no_finish: FakeUpstream,
    start_server: Callable[..., LlamaServer],
    start_proxy: Callable[..., Mitmdump],
) -> None:
    """Nothing is left to write, and the end the server would have sent never came: the
    client is told so in-band, and no server writes a token past the limit."""
    fallback = start_server("fallback")
    proxy = start_proxy(no_finish.url, [fallback.url])
    proxy.servers_known()
    stream = read_stream(proxy.url, chat_body(LIMIT, logprobs=True))
    assert stream.notes == [] and content_tokens(stream) == LIMIT
    (error,) = stream.errors
    assert f"all the {LIMIT} tokens its request allows" in error["error"]["message"]
    assert error["error"]["message"].startswith("no server could continue this answer")
