"""The wire formats' own logic, event by event: what a first leg's events are to the
pump, and how a continuation leg's events are rewritten into the client's stream. The
end-to-end proof with real servers and official clients is in test_other_apis.py and
test_ollama_api.py; these cover what llama-server does not send (sequence numbers,
output indexes, a fallback that opens another kind of block, a tool call)."""

from __future__ import annotations

import json
from typing import Any

from addon.formats.chat import Chat
from addon.formats.dialect import EchoStrip, Step
from addon.formats.messages import Messages, MessagesReader, MessagesRewriter
from addon.formats.ollama import LineSplitter, Ollama, OllamaGenerate, OllamaReader
from addon.formats.responsejoin import ResponsesRewriter
from addon.formats.responses import Responses, ResponsesReader
from addon.formats.transcript import Transcript


def event(payload: dict[str, Any]) -> bytes:
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}".encode()


def delivered(reader_type, payloads: list[dict[str, Any]]) -> Transcript:
    """A transcript of a first leg whose events all went out."""
    transcript = Transcript()
    transcript.begin_leg("http://primary")
    reader = reader_type(transcript, None, "http://primary")
    for payload in payloads:
        for taken in reader.take(event(payload)):
            if taken.payload is not None:
                reader.record(taken.payload)
    return transcript


def text_delta(text: str, index: int = 0) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index,
            "delta": {"type": "text_delta", "text": text}}  # fmt: skip


def block_start(index: int, kind: str = "text") -> dict[str, Any]:
    return {"type": "content_block_start", "index": index, "content_block": {"type": kind}}


MESSAGE_START = {"type": "message_start", "message": {"id": "msg_1", "model": "big"}}


def test_a_messages_continuation_goes_on_in_the_open_block() -> None:
    transcript = delivered(MessagesReader, [MESSAGE_START, block_start(0), text_delta(" the")])
    assert transcript.text == " the" and transcript.wire["block"] == (0, "text")
    body = Messages().continuation(
        {"messages": [{"role": "user", "content": "q"}], "max_tokens": 10}, transcript
    )
    assert body["max_tokens"] == 9
    assert body["messages"][-1] == {"role": "assistant",
                                    "content": [{"type": "text", "text": " the"}]}  # fmt: skip
    rewriter = MessagesRewriter(transcript, " the", echo=True)
    transcript.begin_leg("http://fallback")
    out = [
        *rewriter.rewrite({"type": "message_start", "message": {"id": "msg_2"}}),
        *rewriter.rewrite(block_start(0)),
        *rewriter.rewrite(text_delta(" the river")),
        *rewriter.rewrite({"type": "content_block_stop", "index": 0}),
        *rewriter.rewrite({"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                           "usage": {"output_tokens": 9}}),
    ]  # fmt: skip
    assert out == [
        text_delta(" river"),
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
         "usage": {"output_tokens": 10}},
    ]  # fmt: skip


def thinking_delta(text: str, index: int = 0) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index,
            "delta": {"type": "thinking_delta", "thinking": text}}  # fmt: skip


def test_a_fallback_that_opens_another_kind_of_block_closes_the_clients_first() -> None:
    thinking = [MESSAGE_START, block_start(0, "thinking"), thinking_delta(" hm")]
    transcript = delivered(MessagesReader, thinking)
    assert transcript.reasoning_text == " hm" and not transcript.text
    body = Messages().continuation({"messages": [], "max_tokens": 9}, transcript)
    assert body["messages"][-1]["content"] == [
        {"type": "thinking", "thinking": " hm", "signature": ""}
    ]
    rewriter = MessagesRewriter(transcript, "", echo=True)
    assert rewriter.rewrite(block_start(0)) == [
        {"type": "content_block_stop", "index": 0},
        block_start(1),
    ]
    assert rewriter.rewrite(text_delta(" so")) == [text_delta(" so", 1)]


def test_thinking_goes_on_in_the_clients_block_and_a_restatement_is_dropped() -> None:
    thinking = [MESSAGE_START, block_start(0, "thinking"), thinking_delta(" hm")]
    going_on = MessagesRewriter(delivered(MessagesReader, thinking), "", echo=True)
    assert going_on.rewrite(block_start(0, "thinking")) == []
    assert going_on.rewrite(thinking_delta(" hm, yes")) == [thinking_delta(", yes")]
    answered = [*thinking, {"type": "content_block_stop", "index": 0}, block_start(1),
                text_delta(" So")]  # fmt: skip
    transcript = delivered(MessagesReader, answered)
    assert transcript.wire["block"] == (1, "text")
    restating = MessagesRewriter(transcript, " So", echo=True)
    assert restating.rewrite(block_start(0, "thinking")) == []
    assert restating.rewrite(thinking_delta(" hm")) == []
    assert restating.rewrite({"type": "content_block_stop", "index": 0}) == []
    assert restating.rewrite(block_start(1)) == []
    assert restating.rewrite(text_delta(" So it", 1)) == [text_delta(" it", 1)]


def test_a_tool_use_block_goes_out_whole_and_ends_what_can_be_continued() -> None:
    transcript = Transcript()
    transcript.begin_leg("http://primary")
    reader = MessagesReader(transcript, None, "http://primary")
    assert [e.step for e in reader.take(event({"type": "content_block_stop", "index": 0}))] == [
        Step.HOLD
    ]
    assert reader.take(event(block_start(1, "tool_use"))) == []
    json_delta = {"type": "content_block_delta", "index": 1,
                  "delta": {"type": "input_json_delta", "partial_json": "{}"}}  # fmt: skip
    assert reader.take(event(json_delta)) == []
    (whole,) = reader.take(event({"type": "content_block_stop", "index": 1}))
    assert whole.step is Step.SEND and whole.data.count(b"event: ") == 3
    reader.record(whole.payload)
    assert Messages().cannot_continue({"messages": []}, transcript) is not None
    assert [e.step for e in reader.take(event({"type": "message_delta"}))] == [Step.FINISH]
    assert reader.close() == b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


def response_events(item: str, seq: int, at: int) -> list[dict[str, Any]]:
    return [
        {"type": "response.created", "response": {"id": f"resp_{item}"}, "sequence_number": seq},
        {"type": "response.output_item.added", "output_index": at, "sequence_number": seq + 1,
         "item": {"type": "message", "id": item, "content": []}},
        {"type": "response.content_part.added", "item_id": item, "output_index": at,
         "content_index": 0, "sequence_number": seq + 2},
    ]  # fmt: skip


def test_a_responses_continuation_numbers_and_indexes_its_events_as_the_clients() -> None:
    first = [*response_events("msg_a", 0, 1)]
    first.append({"type": "response.output_text.delta", "item_id": "msg_a", "output_index": 1,
                  "content_index": 0, "delta": " the", "sequence_number": 3})  # fmt: skip
    transcript = delivered(ResponsesReader, first)
    assert transcript.wire == {"seq": 3, "response": "resp_msg_a", "open": "message",
                               "items": {"message": ("msg_a", 1)}, "next": 2}  # fmt: skip
    body = Responses().continuation({"input": "q", "max_output_tokens": 5}, transcript)
    assert body["input"] == [
        {"role": "user", "content": "q"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": " the"}]},
    ]  # fmt: skip
    assert body["max_output_tokens"] == 4
    transcript.begin_leg("http://fallback")
    rewriter = ResponsesRewriter(transcript, " the", echo=None)
    assert all(rewriter.rewrite(e) == [] for e in response_events("msg_b", 0, 0))
    (delta,) = rewriter.rewrite({"type": "response.output_text.delta", "item_id": "msg_b",
                                 "output_index": 0, "content_index": 0, "delta": " the river",
                                 "sequence_number": 3})  # fmt: skip
    assert delta == {"type": "response.output_text.delta", "item_id": "msg_a", "output_index": 1,
                     "content_index": 0, "delta": " river", "sequence_number": 4}  # fmt: skip
    transcript.add(" river")
    text_done = {"type": "response.output_text.done", "item_id": "msg_b", "output_index": 0,
                 "text": " river", "sequence_number": 4}  # fmt: skip
    (done,) = rewriter.rewrite(text_done)
    assert done["text"] == " the river" and done["sequence_number"] == 5
    completed = {"type": "response.completed", "sequence_number": 7, "response": {
        "id": "resp_msg_b", "output": [{"type": "message", "id": "msg_b",
                                        "content": [{"type": "output_text", "text": " river"}]}],
        "usage": {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}}}  # fmt: skip
    (end,) = rewriter.rewrite(completed)
    response = end["response"]
    assert response["id"] == "resp_msg_a" and end["sequence_number"] == 6
    assert response["output"][0]["id"] == "msg_a"
    assert response["output"][0]["content"][0]["text"] == " the river"
    assert response["usage"] == {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}


def test_a_response_whose_server_died_after_its_text_ends_whole() -> None:
    transcript = delivered(ResponsesReader, response_events("msg_a", 0, 0))
    reader = ResponsesReader(transcript, None, "http://primary")
    assert reader.close() is None  # mid-answer: a cut, handed off
    done = {"type": "response.output_text.done", "item_id": "msg_a", "text": ""}
    assert [e.step for e in reader.take(event(done))] == [Step.HOLD]
    end = json.loads(reader.close().split(b"data: ")[1])
    assert end["type"] == "response.completed"
    assert end["response"]["id"] == "resp_msg_a"
    assert end["response"]["output"][0]["id"] == "msg_a"


def test_ollama_lines_split_across_reads_arrive_whole() -> None:
    splitter = LineSplitter()
    assert splitter.feed(b'{"a":1}\n{"b"') == b'{"a":1}\n'
    assert splitter.feed(b":2}\n") == b'{"b":2}\n'
    transcript = Transcript()
    transcript.begin_leg("http://primary")
    reader = OllamaReader(transcript, None, "http://primary")
    assert reader.take(b'{"error":"boom"}') == "in-band error from http://primary: boom"
    assert reader.take(b"not json").startswith("garbled line from http://primary")
    (piece,) = reader.take(b'{"message":{"role":"assistant","content":" the"},"done":false}')
    reader.record(piece.payload)
    (last,) = reader.take(b'{"message":{"content":""},"done":true}')
    assert last.step is Step.END
    body = Ollama().continuation({"messages": [], "options": {"num_predict": 3}}, transcript)
    assert body == {"messages": [{"role": "assistant", "content": " the"}],
                    "options": {"num_predict": 2}}  # fmt: skip


def reasoning_added(item: str) -> dict[str, Any]:
    return {"type": "response.output_item.added",
            "item": {"type": "reasoning", "id": item, "summary": [], "content": []}}  # fmt: skip


def reasoning_delta(item: str, text: str) -> dict[str, Any]:
    return {"type": "response.reasoning_text.delta", "item_id": item, "delta": text}


def test_responses_reasoning_goes_on_in_the_clients_item_then_a_message_follows() -> None:
    created = {"type": "response.created", "response": {"id": "resp_a"}}
    transcript = delivered(ResponsesReader, [created, reasoning_added("rs_a"),
                                             reasoning_delta("rs_a", " hm")])  # fmt: skip
    body = Responses().continuation({"input": "q"}, transcript)
    thought = [{"type": "reasoning_text", "text": " hm"}]
    assert body["input"][-1] == {"type": "reasoning", "summary": [], "content": thought}
    transcript.begin_leg("http://fallback")
    rewriter = ResponsesRewriter(transcript, "", echo=True)
    assert rewriter.rewrite({**created, "response": {"id": "resp_b"}}) == []
    assert rewriter.rewrite(reasoning_added("rs_b")) == []
    assert rewriter.rewrite(reasoning_delta("rs_b", " hm, so")) == [reasoning_delta("rs_a", ", so")]
    transcript.add(None, ", so")
    (done,) = rewriter.rewrite({"type": "response.output_item.done",
                                "item": {"type": "reasoning", "id": "rs_b"}})  # fmt: skip
    assert done["item"]["id"] == "rs_a"
    assert done["item"]["content"] == [{"type": "reasoning_text", "text": " hm, so"}]
    message = {"type": "response.output_item.added", "item": {"type": "message", "id": "m_b"}}
    assert rewriter.rewrite(message) == [message]  # the client's reasoning was closed already
    transcript.add(" Yes")
    completed = {"type": "response.completed", "response": {"id": "resp_b", "output": [
        {"type": "message", "id": "m_b", "content": [{"type": "output_text", "text": " Yes"}]},
    ]}}  # fmt: skip
    (end,) = rewriter.rewrite(completed)
    assert [(i["type"], i["id"]) for i in end["response"]["output"]] == [
        ("reasoning", "rs_a"),
        ("message", "m_b"),
    ]


def test_responses_reasoning_restated_after_the_text_began_is_dropped() -> None:
    first = [*response_events("msg_a", 0, 1)]
    first[1:1] = [reasoning_added("rs_a") | {"output_index": 0}, reasoning_delta("rs_a", " hm")]
    first.append({"type": "response.output_text.delta", "item_id": "msg_a", "delta": " So"})
    transcript = delivered(ResponsesReader, first)
    rewriter = ResponsesRewriter(transcript, " So", echo=True)
    assert rewriter.rewrite(reasoning_added("rs_b") | {"output_index": 0}) == []
    assert rewriter.rewrite(reasoning_delta("rs_b", " hm")) == []
    added = {"type": "response.output_item.added", "output_index": 1,
             "item": {"type": "message", "id": "msg_b"}}  # fmt: skip
    assert rewriter.rewrite(added) == []
    (delta,) = rewriter.rewrite({"type": "response.output_text.delta", "item_id": "msg_b",
                                 "output_index": 1, "delta": " So it"})  # fmt: skip
    assert (delta["item_id"], delta["delta"], delta["output_index"]) == ("msg_a", " it", 1)


def test_an_answer_that_begins_like_the_prefill_is_kept_when_the_echo_is_unknown() -> None:
    unknown = EchoStrip(" night rain", None)
    assert unknown(" night") == " night" and unknown(" rain") == " rain"
    assert EchoStrip(" night rain", None)(" night rain falls") == " falls"
    known = EchoStrip(" night rain", True)
    assert known(" night") == "" and known(" rain falls") == " falls"


def test_a_bound_on_tokens_counts_every_turn_of_each_api_and_only_text() -> None:
    """Bytes of every text the template renders (system, instructions, reasoning), 32 per
    turn and the limit on what is written, in each API's own fields; no bound for what
    only a server can count."""
    turn = 32
    user = {"role": "user", "content": "abc"}
    chat = Chat("messages")
    thought = {"role": "assistant", "content": "de", "reasoning_content": "fgh"}
    assert chat.upper_bound({"messages": [user, thought], "max_tokens": 5}) == 8 + 2 * turn + 5
    assert Chat("prompt").upper_bound({"prompt": "abcd", "n_predict": 5}) == 4 + turn + 5
    replay = {"prompt": ["ab", 7, 8, "c"], "n_predict": 5}  # rendered text and token ids
    assert chat.upper_bound(replay) == 2 + 3 + turn + 5
    assert chat.upper_bound({"messages": [user], "tools": [{"type": "function"}]}) is None
    called = {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}
    assert chat.upper_bound({"messages": [user, called]}) is None
    image = {"type": "image_url", "image_url": {"url": "data:"}}
    assert chat.upper_bound({"messages": [{"role": "user", "content": [image]}]}) is None
    odd = [{"type": ["text"], "text": "a"}, "a", {"type": "text", "text": 1}]
    assert all(
        chat.upper_bound({"messages": [{"role": "user", "content": [o]}]}) is None for o in odd
    )

    blocks = [{"type": "thinking", "thinking": "ab"}, {"type": "text", "text": "cd"}]
    messages = {"system": "sys", "messages": [user, {"role": "assistant", "content": blocks}]}
    assert Messages().upper_bound({**messages, "max_tokens": 7}) == 10 + 3 * turn + 7
    tool_use = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    used = {"messages": [user, {"role": "assistant", "content": [tool_use]}]}
    assert Messages().upper_bound(used) is None

    thinking = [{"type": "reasoning_text", "text": "ab"}]
    reasoning = {"type": "reasoning", "summary": [], "content": thinking}
    said = {"role": "assistant", "content": [{"type": "output_text", "text": "cd"}]}
    responses = {"instructions": "sys", "input": [user, reasoning, said], "max_output_tokens": 7}
    assert Responses().upper_bound(responses) == 10 + 4 * turn + 7
    assert Responses().upper_bound({"input": "abc"}) == 3 + 2 * turn
    call = {"type": "function_call", "call_id": "1", "name": "f", "arguments": "{}"}
    assert Responses().upper_bound({"input": [user, call]}) is None

    ollama = {"messages": [user, {"role": "assistant", "content": "de", "thinking": "f"}]}
    assert Ollama().upper_bound({**ollama, "options": {"num_predict": 9}}) == 6 + 2 * turn + 9
    assert Ollama().upper_bound({**ollama, "options": {"num_predict": -1}}) == 6 + 2 * turn
    pictured = {"messages": [{"role": "user", "content": "what is this", "images": ["aGk="]}]}
    assert Ollama().upper_bound(pictured) is None
    generate = {"system": "sys", "prompt": "abc", "options": {"num_predict": 4}}
    assert OllamaGenerate().upper_bound(generate) == 6 + 2 * turn + 4
