"""The rest of the budget is counted in tokens, not in chunks: a chunk that carries two
tokens (llama-server holds back half of a character, or the start of a stop string, and
sends both tokens' text and logprobs in one chunk) counts two, so the next server is
asked for exactly what the client's `max_tokens` leaves.

The primary is a stand-in: the tiny models' vocabularies have no byte tokens, so no real
server here splits a character on demand. The chunk it sends is the shape llama-server
writes (the `logprobs.content` entries with each token's id and bytes)."""

from __future__ import annotations

import json

from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.scripted_upstream import STREAM_HEAD, FakeUpstream, chunked
from tests.streams import assert_one_clean_stream, chat_body, continuation, read_stream

LIMIT = 40


def chunk(text: str, tokens: list[tuple[int, bytes]], role: bool = False) -> bytes:
    delta = {"role": "assistant", "content": text} if role else {"content": text}
    entries = [
        {"id": token, "token": data.decode(errors="replace"), "bytes": list(data), "logprob": -0.1}
        for token, data in tokens
    ]
    body = {
        "id": "chatcmpl-stand-in", "created": 1, "model": "stand-in",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": None,
                     "logprobs": {"content": entries}}],
    }  # fmt: skip
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


def test_a_chunk_of_two_tokens_counts_two_toward_the_clients_limit(
    start_proxy, fallback: LlamaServer
) -> None:
    frames = [
        chunk(" the", [(11, b" the")], role=True),
        chunk(" caf", [(12, b" caf")]),
        chunk("é", [(13, b"\xc3"), (14, b"\xa9")]),  # one character, two tokens
        chunk(" is", [(15, b" is")]),
    ]
    # The stand-in dies after its fourth chunk: five tokens went out in four chunks.
    primary = FakeUpstream([(STREAM_HEAD + chunked(*frames), 0.2)])
    proxy = start_proxy(primary.url, [fallback.url])
    proxy.servers_known()
    body = {**chat_body(LIMIT), "stream_options": {"include_usage": True}}
    stream = read_stream(proxy.url, body)
    assert_one_clean_stream(stream)
    before, after = stream.segments
    assert before == " the café is"
    assert after == continuation(fallback.url, before, LIMIT - 5)
    (usage,) = [c["usage"] for c in stream.chunks if c.get("usage")]
    legs = usage["spillover"]["legs"]
    assert [leg["completion_tokens"] for leg in legs] == [5, LIMIT - 5]
    assert usage["completion_tokens"] == LIMIT
    primary.close()
