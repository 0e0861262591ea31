"""The rest of the budget is counted in tokens, not in chunks: a chunk that carries two
tokens counts two, so the next server is asked for exactly what the client's
`max_tokens` leaves. llama-server holds back the first tokens of a character (or the
start of a stop string) and sends them in one chunk with ONE logprobs entry (the last
token's id, all the bytes); asked for `timings_per_token`, each chunk also says how many
tokens it has generated (`timings.predicted_n`), which is what counts. A server that
sends one entry per token (as vLLM's ids do) is counted by its entries.

The primary is a stand-in: the tiny models' vocabularies have no byte tokens, so no tiny
model splits a character on demand (Gemma 3 does: tests/test_real_model.py). Its chunks
are the shapes llama-server and an entry-per-token server write."""

from __future__ import annotations

import json

import pytest

from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.scripted_upstream import STREAM_HEAD, FakeUpstream, chunked
from tests.streams import assert_one_clean_stream, chat_body, continuation, read_stream

LIMIT = 40


def chunk(
    text: str, tokens: list[tuple[int, bytes]], role: bool = False, made: int | None = None
) -> bytes:
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
    if made is not None:
        body["timings"] = {"predicted_n": made}
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


@pytest.mark.parametrize("shape", ["an entry per token", "llama-server's count"])
def test_a_chunk_of_two_tokens_counts_two_toward_the_clients_limit(
    start_proxy, fallback: LlamaServer, shape: str
) -> None:
    counted = shape == "llama-server's count"
    if not counted:
        character = chunk("é", [(13, b"\xc3"), (14, b"\xa9")])  # one character, two tokens
    else:
        character = chunk("é", [(14, "é".encode())], made=4)  # the last token's id only
    frames = [
        chunk(" the", [(11, b" the")], role=True, made=1 if counted else None),
        chunk(" caf", [(12, b" caf")], made=2 if counted else None),
        character,
        chunk(" is", [(15, b" is")], made=5 if counted else None),
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
