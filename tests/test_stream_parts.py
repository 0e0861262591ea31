"""The splice's pure parts, without servers: SSE framing, chunked decoding, continuation."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from addon.formats import sse
from addon.formats.blocks import ordinary_chunks
from addon.formats.chat import ChatReader
from addon.formats.continuation import ChunkRewriter, cannot_continue, continuation_body, prefill_of
from addon.formats.pieces import (
    LOGPROBS,
    LOGPROBS_COUNTED,
    TOKEN_IDS,
    take_pieces,
    without_pieces,
)
from addon.formats.toolcalls import ToolCallHold
from addon.formats.transcript import Transcript
from addon.handoff.exact import NativeToChat, native_body
from addon.servers.framing import ChunkedBody, LengthBody, UpstreamError
from scripts.testbed.scripted_upstream import chunked, sse_chunk

STREAM = (
    sse_chunk(role=True) + sse_chunk(" the") + b": ping\n\n" + sse_chunk(" river")
    + sse_chunk(finish="length") + b"data: [DONE]\n\n"
)  # fmt: skip


def cuts(data: bytes, points: list[int]) -> list[bytes]:
    edges = sorted({0, len(data), *(p % (len(data) + 1) for p in points)})
    return [data[a:b] for a, b in itertools.pairwise(edges)]


@given(st.lists(st.integers(min_value=0), max_size=12))
def test_splitter_finds_the_same_events_however_the_bytes_arrive(points: list[int]) -> None:
    splitter = sse.EventSplitter()
    found = [e for part in cuts(STREAM, points) for e in sse.events(splitter.feed(part))]
    assert found == sse.events(STREAM)
    assert len(found) == 6 and sse.is_done(found[-1]) and sse.is_comment(found[2])


@given(st.lists(st.integers(min_value=0), max_size=12))
def test_splitter_reads_crlf_streams_however_the_bytes_arrive(points: list[int]) -> None:
    splitter = sse.EventSplitter()
    crlf = STREAM.replace(b"\n", b"\r\n")
    found = [e for part in cuts(crlf, points) for e in sse.events(splitter.feed(part))]
    assert found == sse.events(STREAM)


def test_an_event_over_the_limit_is_refused_as_it_grows() -> None:
    splitter = sse.EventSplitter(limit=1000)
    assert splitter.feed(b"data: {}\n\ndata: {") == b"data: {}\n\n"
    splitter.feed(b"x" * 900)
    with pytest.raises(sse.EventTooLarge):
        splitter.feed(b"x" * 200)


def test_splitter_accepts_crlf_streams() -> None:
    splitter = sse.EventSplitter()
    block = splitter.feed(STREAM.replace(b"\n", b"\r\n")[:-3]) + splitter.feed(b"\r\n\r\n"[-3:])
    assert sse.events(block) == sse.events(STREAM)


def test_only_plain_token_chunks_skip_parsing() -> None:
    plain = sse_chunk(" the") + sse_chunk(" river")
    assert ordinary_chunks(plain) is not None
    for unusual in (
        sse_chunk(role=True) + b": ping\n\n",
        sse_chunk(finish="stop"),
        b'data: {"choices":[{"index":0,"delta":{},"finish_reason" : "length"}]}\n\n',
        b'data: {"error":{"message":"x"}}\n\n',
        b"data: [DONE]\n\n",
        b'data: {"choices":[],"usage":{"completion_tokens":1}}\n\n',
        b'data: {"choices":[{"delta":{"tool_calls":[]}}]}\n\n',
        b'data: {"choices":[{"delta":{"content":"x"},"finish_reason":7}]}\n\n',
        # A key written twice: JSON readers take the last, and so does this one.
        b'data: {"choices":[{"finish_reason":null}],"choices":[{"finish_reason":"stop"}]}\n\n',
        b"data: {truncated\n\n",
        b'event: x\ndata: {"choices":[]}\n\n',
        b"data: []\n\n",
        b"\xff\xfe garbage\n\n",
    ):
        assert ordinary_chunks(plain + unusual) is None, unusual
    # Text that merely mentions the markers stays on the fast path.
    assert ordinary_chunks(sse_chunk(' the "error" word, "usage", "tool_calls"')) is not None
    assert ordinary_chunks(b'data: {"choices":[{"delta":{"content":"error"}}]}\n\n') is not None


@given(st.lists(st.integers(min_value=0), max_size=20))
def test_chunked_body_decodes_however_the_bytes_arrive(points: list[int]) -> None:
    wire = chunked(b"hello ", b"chunked", b" world") + b"0\r\n\r\n"
    body = ChunkedBody()
    assert b"".join(body.feed(part) for part in cuts(wire, points)) == b"hello chunked world"
    assert body.complete


def test_chunked_body_reads_a_chunk_a_read_as_any_other_way() -> None:
    """A server that writes each token as its own chunk is read whole chunk by chunk
    (the way taken at full speed); what that way does not take goes the general way."""
    chunks = [b"5\r\nhello\r\n", b"1;ext=1\r\n \r\n", b"10\r\n" + b"x" * 16 + b"\r\n"]
    wire = b"".join(chunks) + b"0\r\n\r\n"
    expected = b"hello " + b"x" * 16
    body = ChunkedBody()
    assert b"".join(body.feed(chunk) for chunk in [*chunks, b"0\r\n\r\n"]) == expected
    assert body.complete
    for size in (1, 3, len(wire)):
        body = ChunkedBody()
        parts = [wire[at : at + size] for at in range(0, len(wire), size)]
        assert b"".join(body.feed(part) for part in parts) == expected and body.complete
    with pytest.raises(UpstreamError, match="terminator"):
        ChunkedBody().feed(b"5\r\nhelloXY\r\n")  # the size and the end disagree


def test_chunked_body_rejects_broken_framing() -> None:
    with pytest.raises(UpstreamError, match="chunk size"):
        ChunkedBody().feed(b"zz\r\nabc\r\n")
    with pytest.raises(UpstreamError, match="terminator"):
        ChunkedBody().feed(b"3\r\nabcXY")


def test_length_body_stops_at_its_length() -> None:
    body = LengthBody(5)
    assert body.feed(b"abc") == b"abc" and not body.complete
    assert body.feed(b"defgh") == b"de" and body.complete
    assert LengthBody(None).until_close


def delivered(*texts: str, echoes: bool | None = False) -> Transcript:
    transcript = Transcript()
    transcript.begin_leg("http://primary", echoes=echoes)
    reader = ChatReader(transcript, None, False, "http://primary")
    block = sse_chunk(role=True) + b"".join(sse_chunk(t) for t in texts)
    assert reader.plain(block) == block  # forwarded unread, and read as it goes
    return transcript


def test_transcript_reads_forwarded_blocks() -> None:
    transcript = delivered(" the", " river")
    assert transcript.text == " the river" and transcript.produced == 2
    assert transcript.role_sent and transcript.id == "chatcmpl-fake"


def test_continuation_appends_the_delivered_text_and_lowers_limits() -> None:
    original = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "n_predict": 1}
    body = continuation_body(original, delivered(" the", " river"))
    assert body["messages"][-1] == {"role": "assistant", "content": " the river"}
    assert body["max_tokens"] == 8 and body["n_predict"] == 1
    assert original["messages"] == [{"role": "user", "content": "hi"}]  # not mutated
    assert continuation_body(original, delivered()) == original


@pytest.mark.parametrize(
    ("answer", "echoes", "expected"),
    [
        (" the river", False, "Once the river"),
        ("Once the river", True, "Once the river"),
        ("Once", True, "Once"),  # cut inside the echo: nothing written yet
        # An answer that begins with the prefill's own words from a server that sends
        # none back: the words are the model's (a guess from the text lost them).
        ("Once more", False, "OnceOnce more"),
    ],
)
def test_continuation_extends_a_client_prefill(answer: str, echoes: bool, expected: str) -> None:
    """Servers that echo a prefill sent it to the client already; others did not: the
    transcript knows which from the request and the engine (handoff/seen.py)."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    original = {"messages": messages}
    body = continuation_body(original, delivered(answer, echoes=echoes))
    assert prefill_of(body) == expected and len(body["messages"]) == 2


def test_an_echo_not_known_is_not_continued() -> None:
    """A first server whose echo is not known (an engine the addon cannot tell, never
    probed) leaves what the model wrote after the prefill unknown: not continued."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    why = cannot_continue({"messages": messages}, delivered("Once upon", echoes=None))
    assert why is not None and "sent the client's assistant prefill back" in why
    assert cannot_continue({"messages": messages}, delivered("Once upon")) is None


def rewrite_all(rewriter: ChunkRewriter, texts: list[str]) -> str:
    out = ""
    for text in texts:
        chunk = json.loads(sse_chunk(text)[6:])
        if (rewritten := rewriter.rewrite(chunk)) is not None:
            out += rewritten["choices"][0]["delta"].get("content", "")
    return out


def test_echo_is_removed_even_when_split_across_deltas() -> None:
    rewriter = ChunkRewriter(delivered(" the river"), " the river", echo=True)
    assert rewrite_all(rewriter, [" the", " river bridge", " stone"]) == " bridge stone"


def test_no_echo_server_keeps_text_that_looks_like_the_prefill() -> None:
    rewriter = ChunkRewriter(delivered(" the"), " the", echo=False)
    assert rewrite_all(rewriter, [" the", " river"]) == " the river"


def test_unknown_echo_is_judged_on_the_first_delta() -> None:
    assert rewrite_all(ChunkRewriter(delivered(" a"), " a", echo=None), [" a b", " c"]) == " b c"
    assert rewrite_all(ChunkRewriter(delivered(" a"), " a", echo=None), [" x", " a"]) == " x a"


def test_rewriter_keeps_the_first_legs_identity_and_one_role() -> None:
    transcript = delivered(" the")
    transcript.begin_leg("http://fallback")
    rewriter = ChunkRewriter(transcript, " the", echo=True)
    role = json.loads(sse_chunk(role=True)[6:]) | {"id": "other", "created": 99}
    assert rewriter.rewrite(role) is None
    chunk = json.loads(sse_chunk(" the river")[6:]) | {"id": "other", "created": 99}
    rewritten = rewriter.rewrite(chunk)
    assert rewritten["id"] == "chatcmpl-fake" and rewritten["created"] == 1
    assert rewritten["choices"][0]["delta"] == {"content": " river"}


def test_usage_covers_every_leg() -> None:
    transcript = delivered(" a", " b", " c")
    transcript.begin_leg("http://fallback")
    rewriter = ChunkRewriter(transcript, "", echo=False)
    usage = {"completion_tokens": 5, "prompt_tokens": 40, "total_tokens": 45}
    rewritten = rewriter.rewrite({"id": "x", "choices": [], "usage": usage})
    merged = rewritten["usage"]
    assert merged["completion_tokens"] == 8 and merged["total_tokens"] == 48
    legs = merged["spillover"]["legs"]
    assert [(leg["server"], leg["completion_tokens"]) for leg in legs] == [
        ("http://primary", 3),
        ("http://fallback", 5),
    ]


def test_some_answers_cannot_be_continued_elsewhere() -> None:
    plain = {"messages": [], "max_tokens": 10}
    assert cannot_continue(plain, delivered(" the")) is None
    schema = {**plain, "response_format": {"type": "json_schema", "json_schema": {}}}
    assert "response_format" in cannot_continue(schema, delivered(" {"))
    assert cannot_continue(schema, delivered()) is None  # nothing out yet: start over freely
    assert cannot_continue({**plain, "response_format": {"type": "text"}}, delivered(" a")) is None
    calling = delivered()
    calling.record({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {}}]}}]})
    assert "tool_calls" in cannot_continue(plain, calling)


def test_tool_call_pieces_are_held_until_the_call_is_whole() -> None:
    hold = ToolCallHold()

    def chunk(*pieces: dict, content: str | None = None) -> dict:
        delta: dict = {"tool_calls": list(pieces)}
        if content:
            delta["content"] = content
        return {"id": "x", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}

    first = {
        "index": 0,
        "id": "a",
        "type": "function",
        "function": {"name": "f", "arguments": '{"k"'},
    }
    rest, ready = hold.split(chunk(first, content=" hi"))
    assert ready == [] and rest["choices"][0]["delta"] == {"content": " hi"}
    assert hold.split(chunk({"index": 0, "function": {"arguments": ": 1}"}})) == (None, [])
    second = {"index": 1, "id": "b", "function": {"name": "g", "arguments": "{}"}}
    _, ready = hold.split(chunk(second))
    assert ready == [{"index": 0, "id": "a", "type": "function",
                      "function": {"name": "f", "arguments": '{"k": 1}'}}]  # fmt: skip
    assert [c["id"] for c in hold.flush()] == ["b"] and hold.flush() == []


def test_sampling_parameters_travel_with_the_continuation() -> None:
    original = {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True,
        "temperature": 0.7, "top_p": 0.9, "seed": 3, "stop": ["\n\n"], "logprobs": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    body = continuation_body(original, delivered(" a", " b"))
    unchanged = {k: v for k, v in original.items() if k not in ("messages", "max_tokens")}
    assert {k: body[k] for k in unchanged} == unchanged and body["max_tokens"] == 48


def _with_pieces(text: str, *pieces: tuple[int, str]) -> dict:
    chunk = json.loads(sse_chunk(text)[6:])
    entries = [{"id": i, "token": t, "bytes": list(t.encode())} for i, t in pieces]
    chunk["choices"][0]["logprobs"] = {"content": entries}
    return chunk


def test_exact_ids_are_given_only_when_they_spell_the_delivered_text() -> None:
    transcript = Transcript()
    transcript.begin_leg("http://primary")
    transcript.record(_with_pieces(" th", (7, " th")))
    transcript.record(_with_pieces("e", (9, "e")))
    assert transcript.exact_ids() == [7, 9]
    # A token whose text the server held back: ids and text no longer agree.
    transcript.record(_with_pieces("", (11, "\xe2")), None)
    assert transcript.exact_ids() is None


def test_text_without_ids_turns_exact_replay_off_for_good() -> None:
    transcript = Transcript()
    transcript.begin_leg("http://primary")
    transcript.record(_with_pieces(" the", (5, " the")))
    transcript.record(json.loads(sse_chunk(" river")[6:]))
    assert transcript.ids is None and transcript.exact_ids() is None


def test_ids_taken_out_of_a_chunk_leave_no_logprobs_behind() -> None:
    chunk = _with_pieces(" the", (5, " the"))
    assert take_pieces(chunk, strip=LOGPROBS) == [(5, b" the")]
    assert "logprobs" not in chunk["choices"][0]
    assert take_pieces(chunk, strip=LOGPROBS) is None


def test_native_events_become_chat_chunks() -> None:
    chat = NativeToChat("fallback.gguf", include_usage=True)
    probs = [{"id": 5, "token": " the", "bytes": [32, 116, 104, 101], "prob": 1.0}]
    middle = chat.chunk({"content": " the", "stop": False, "completion_probabilities": probs})
    assert middle["choices"][0]["delta"] == {"content": " the"}
    assert middle["choices"][0]["logprobs"] == {"content": probs}
    assert middle["object"] == "chat.completion.chunk" and middle["model"] == "fallback.gguf"
    last = chat.chunk(
        {"content": "", "stop": True, "stop_type": "limit", "tokens_predicted": 3,
         "tokens_evaluated": 20}
    )  # fmt: skip
    assert last["choices"][0]["finish_reason"] == "length" and last["choices"][0]["delta"] == {}
    assert last["usage"] == {"completion_tokens": 3, "prompt_tokens": 20, "total_tokens": 23}
    eos = chat.chunk({"content": ".", "stop": True, "stop_type": "eos"})
    assert eos["choices"][0]["finish_reason"] == "stop"


def test_a_native_continuation_keeps_the_sampling_settings_and_counts_down() -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True,
        "temperature": 0.3, "seed": 7, "stop": ["\n"], "tools": None, "top_logprobs": 3,
    }  # fmt: skip
    native = native_body(body, ["<prompt>", 4, 5, 6], produced=3, pieces=True)
    assert native["prompt"] == ["<prompt>", 4, 5, 6] and native["n_predict"] == 47
    assert native["temperature"] == 0.3 and native["seed"] == 7 and native["stop"] == ["\n"]
    assert "messages" not in native and "max_tokens" not in native
    assert native["n_probs"] == 1 and native["post_sampling_probs"] is True
    asked = native_body({**body, "logprobs": True}, ["<prompt>", 4], produced=1, pieces=False)
    assert asked["n_probs"] == 3 and asked["post_sampling_probs"] is False
    # Pieces neither kept nor asked for by the client: none asked of the server.
    assert "n_probs" not in native_body(body, ["<prompt>"], produced=1, pieces=False)


CHUNKS_WITH_PIECES = [
    # llama-server's, as the addon asks them: logprobs with each token's id and bytes.
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" the"},'
    b'"logprobs":{"content":[{"id":278,"token":" the","bytes":[32,116,104,101],'
    b'"logprob":-0.1,"top_logprobs":[{"id":278,"token":" the","logprob":-0.1}]}]}}],'
    b'"created":1,"id":"c","model":"m","object":"chat.completion.chunk"}\n\n',
    # vLLM's: token_ids beside a null logprobs, prompt_token_ids on the first chunk.
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"content":"x"},"logprobs":null,"finish_reason":null,"token_ids":[5,6]}],'
    b'"prompt_token_ids":[1,2]}\n\n',
    # Spaced JSON, the pieces the only member of their object, a text that names the key.
    b'data: {"id": "c", "choices": [{"logprobs": {"content": [{"id": 1, "bytes": [120]}]}}]}\n\n',
    b'data: {"choices":[{"delta":{"content":"\\"logprobs\\":"},"logprobs":{"content":[]}}]}\n\n',
]


@pytest.mark.parametrize("block", CHUNKS_WITH_PIECES)
def test_pieces_cut_from_the_bytes_are_what_parsing_takes_out(block: bytes) -> None:
    """The hot path cuts the ids the client did not ask for out of the server's bytes;
    what is left reads as the parsed way leaves it."""
    strip = TOKEN_IDS if b'"token_ids"' in block else LOGPROBS
    cut = without_pieces(block, strip)
    assert cut is not None
    parsed = json.loads(block[6:])
    take_pieces(parsed, strip)
    assert json.loads(cut[6:]) == parsed
    assert cut.endswith(b"}\n\n")


_MEMBERS = st.dictionaries(
    st.sampled_from(["id", "object", "model", "x"]),
    st.one_of(st.integers(), st.text(max_size=8), st.just({"logprobs": 12})),
    max_size=3,
)


@st.composite
def _counted_chunks(draw) -> dict:
    """A chat chunk with llama-server's logprobs and timings among other members, in any
    order (a nested object may name `logprobs` too)."""
    entry = {"id": draw(st.integers(0, 99)), "bytes": [120], "token": "x"}
    choice = {**draw(_MEMBERS), "delta": {"content": draw(st.text(max_size=5))}}
    choice["logprobs"] = draw(st.sampled_from([{"content": [entry]}, None, 1, 12]))
    chunk = {**draw(_MEMBERS), "choices": [dict(draw(st.permutations(list(choice.items()))))]}
    chunk["timings"] = {"predicted_n": draw(st.integers(0, 9)), "prompt_n": 3}
    return dict(draw(st.permutations(list(chunk.items()))))


@given(
    st.lists(_counted_chunks(), min_size=1, max_size=4),
    st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")]),
)
def test_ids_and_counts_cut_from_a_block_are_what_parsing_takes_out(chunks, separators) -> None:
    """The cut of llama-server's logprobs and timings (the counted ids) out of a block's
    bytes reads, where it is made, as the parsed way leaves each chunk; compact JSON, as
    servers write it, is always cut unless a nested object names the key too."""
    block = b"".join(
        b"data: " + json.dumps(c, separators=separators).encode() + b"\n\n" for c in chunks
    )
    cut = without_pieces(block, LOGPROBS_COUNTED)
    parsed = []
    for chunk in chunks:
        chunk = json.loads(json.dumps(chunk))
        take_pieces(chunk, LOGPROBS_COUNTED)
        del chunk["timings"]
        parsed.append(chunk)
    if cut is not None:
        assert [json.loads(e[6:]) for e in sse.events(cut)] == parsed
    elif separators == (",", ":"):
        assert block.count(b'"logprobs"') > len(chunks)  # nested: left to the parsed way


def test_pieces_written_another_way_are_left_to_the_parsed_way() -> None:
    assert (
        without_pieces(b'data: {"choices": [{"logprobs" : {"content": []}}]}\n\n', LOGPROBS) is None
    )
    assert without_pieces(b'data: {"choices": ["logprobs":{}]}\n\n', LOGPROBS) is None


def _counted(text: str, token: int, raw: str, made: int) -> dict:
    """A chunk as llama-server sends it when asked for ids and its count: one logprobs
    entry (the last token's id, every held byte), `timings.predicted_n`."""
    chunk = _with_pieces(text, (token, raw))
    chunk["timings"] = {"predicted_n": made}
    return chunk


def test_a_character_of_byte_tokens_counts_them_drops_the_ids_and_keeps_the_bytes() -> None:
    """Gemma writes 🪿 as four byte tokens and llama-server sends one chunk for them."""
    transcript = Transcript()
    transcript.begin_leg("http://primary")
    transcript.record(_counted(" Hi", 5, " Hi", 1))
    transcript.record(_counted("🪿", 429, "🪿", 5))
    assert transcript.produced == 5 and transcript.legs[0].completion_tokens == 5
    assert transcript.exact_ids() is None  # three of its ids never came
    assert transcript.raw_output() == " Hi🪿" and not transcript.raw_lost


def test_tokens_the_client_never_saw_leave_the_raw_output_unknown() -> None:
    """A gap no character explains: what the model wrote is not known byte for byte."""
    transcript = Transcript()
    transcript.begin_leg("http://primary")
    transcript.record(_counted("Hi", 5, "Hi", 4))  # e.g. an empty reasoning block before it
    assert transcript.raw_lost and transcript.unseen == 3 and transcript.raw_output() is None
    # With stop strings the server holds text that may start one, and sends it later
    # (as llama-server sent " three model" for the stop " three xyz", one id).
    held = Transcript(stops=(" three xyz",))
    held.begin_leg("http://primary")
    held.record(_counted(" three model", 5, " three model", 2))
    assert not held.raw_lost and held.raw_output() == " three model" and held.produced == 2


def test_hidden_markers_are_not_excused_by_what_follows_them() -> None:
    """Qwen3 with /no_think writes `<think>`, `\n\n`, `</think>`, `\n\n` (four tokens its
    parser shows in no chunk) and then 你好 in one piece: two characters of three bytes
    do not explain the gap (only a character's own earlier byte tokens would), nor do
    stop strings the piece could not have started."""
    for stops in ((), ("\n\nUser:",)):
        transcript = Transcript(stops=stops)
        transcript.begin_leg("http://primary")
        transcript.record(_counted("你好", 5, "你好", 5))
        assert transcript.raw_lost and transcript.raw_output() is None, stops


def test_a_parser_trimmed_space_is_in_the_raw_output() -> None:
    transcript = Transcript()
    transcript.begin_leg("http://primary")
    transcript.record(_counted("Hello", 5, " Hello", 1))
    assert transcript.text == "Hello" and transcript.raw_output() == " Hello"


def _thought_chunk(text: str, ids: list[int] | None = None) -> dict:
    """A chunk as the vLLM builds between its rename of `reasoning_content` and the old
    name's removal (about 0.12 to 0.15) wrote one: the reasoning in both fields, the same
    text (a stand-in: vLLM 0.32, installed here, writes `reasoning` alone)."""
    choice: dict = {"index": 0, "delta": {"reasoning": text, "reasoning_content": text}}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": "chatcmpl-v", "created": 1, "choices": [choice]}


def test_reasoning_in_both_fields_is_one_reasoning_with_its_ids() -> None:
    transcript = Transcript()
    transcript.begin_leg("http://vllm", vocabulary="v")
    transcript.record(_thought_chunk(" the", [7]))
    transcript.record(_thought_chunk(" river", [8]))
    assert transcript.reasoning_text == " the river"
    assert transcript.reasoning_fields == ("reasoning_content", "reasoning")
    assert transcript.exact_ids() == [7, 8], "the ids spell the reasoning once"


def _vllm_chunk(ids: list[int], reasoning: str = "", content: str = "") -> dict:
    delta = {k: v for k, v in (("reasoning", reasoning), ("content", content)) if v}
    return {"id": "v", "created": 1, "choices": [{"index": 0, "delta": delta, "token_ids": ids}]}


# vLLM's chunks of two reasoning tokens, the tag that closes the reasoning (99: no text of
# its own) and one content token, as vLLM sends them when its API server keeps up, and
# when it falls behind and merges the tag with the token before or after it.
CLOSED_REASONING = {
    "the tag alone": [[5], [6], [99], [7]],
    "with the last reasoning token": [[5], [6, 99], [7]],
    "with the first content token": [[5], [6], [99, 7]],
}


@pytest.mark.parametrize("steps", CLOSED_REASONING.values(), ids=list(CLOSED_REASONING))
@pytest.mark.parametrize("typed", [False, True])
def test_vllms_ids_count_the_tag_that_closed_the_reasoning_once(
    steps: list[list[int]], typed: bool
) -> None:
    """However vLLM groups them, its ids count the tag once: the budget left for the
    next server is the answer's (counted twice, the continuation came a token short)."""
    texts = {5: (" a", ""), 6: (" b", ""), 99: ("", ""), 7: ("", " c")}
    transcript = Transcript()
    transcript.begin_leg("http://vllm", vocabulary="v")
    reader = ChatReader(transcript, None, None, "http://vllm")
    for ids in steps:
        reasoning = "".join(texts[i][0] for i in ids)
        content = "".join(texts[i][1] for i in ids)
        chunk = _vllm_chunk(ids, reasoning, content)
        if typed:
            assert reader.plain(b"data: " + json.dumps(chunk).encode() + b"\n\n") is not None
        else:
            transcript.record(chunk)
    assert (transcript.produced, transcript.legs[-1].completion_tokens) == (4, 4)
    assert (transcript.reasoning_text, transcript.text) == (" a b", " c")


def test_llama_servers_tag_is_counted_where_no_piece_carries_it() -> None:
    """llama-server sends no piece for the tag (its parser hides it): its content's first
    token counts it, and nothing takes it back (the server's `timings` recount it where
    asked)."""
    transcript = Transcript()
    transcript.begin_leg("http://llama", vocabulary="v", raw_pieces=True)
    for field, text, token in (("reasoning_content", " a", 5), ("content", " c", 7)):
        entry = {"id": token, "token": text, "bytes": list(text.encode()), "logprob": 0.0}
        delta = {field: text}
        choice = {"index": 0, "delta": delta, "logprobs": {"content": [entry]}}
        transcript.record({"id": "l", "created": 1, "choices": [choice]})
    assert transcript.produced == 3


def test_a_restated_reasoning_in_both_fields_is_taken_out_of_both() -> None:
    """A continuation that writes the reasoning again, in both fields: echoed while the
    reasoning goes on (taken out, the rest in each field the client reads), restated
    whole once the content began (dropped from both)."""
    thinking = Transcript()
    thinking.begin_leg("http://vllm")
    thinking.record(_thought_chunk(" the river"))
    rewriter = ChunkRewriter(thinking, "", echo=True)
    (choice,) = rewriter.rewrite(_thought_chunk(" the river runs"))["choices"]
    assert choice["delta"] == {"reasoning_content": " runs", "reasoning": " runs"}
    answered = Transcript()
    answered.begin_leg("http://vllm")
    answered.record(_thought_chunk(" the river"))
    answered.record({"choices": [{"index": 0, "delta": {"content": "It runs."}}]})
    assert ChunkRewriter(answered, "", echo=True).rewrite(_thought_chunk(" the river")) is None
