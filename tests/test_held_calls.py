"""Calls in the typed-event APIs held whole however the server interleaves them
(formats/heldcalls.py), event by event: llama-server opens every call of an answer
before it closes any, and a Responses call while its message is open (the same on real
servers: tests/test_tool_calls_apis.py)."""

from __future__ import annotations

import json
from typing import Any

from addon.formats.dialect import Step
from addon.formats.messages import MessagesReader
from addon.formats.responsejoin import ResponsesRewriter
from addon.formats.responses import ResponsesReader
from addon.formats.transcript import Transcript
from tests.test_wire_formats import delivered, event, response_events


def reader_of(reader_type: Any) -> Any:
    transcript = Transcript()
    transcript.begin_leg("http://primary")
    return reader_type(transcript, None, "http://primary")


def tool_event(kind: str, index: int) -> dict[str, Any]:
    if kind == "start":
        return {"type": "content_block_start", "index": index,
                "content_block": {"type": "tool_use", "id": f"t{index}", "name": "f"}}  # fmt: skip
    if kind == "delta":
        return {"type": "content_block_delta", "index": index,
                "delta": {"type": "input_json_delta", "partial_json": f"{{{index}"}}  # fmt: skip
    return {"type": "content_block_stop", "index": index}


def test_messages_tool_blocks_opened_together_each_go_out_whole() -> None:
    reader = reader_of(MessagesReader)
    order = [("start", 0), ("delta", 0), ("start", 1), ("delta", 1), ("delta", 0),
             ("stop", 0), ("stop", 1)]  # fmt: skip
    sent = [e for kind, index in order for e in reader.take(event(tool_event(kind, index)))]
    assert [e.step for e in sent] == [Step.SEND, Step.SEND]
    for index, whole in enumerate(sent):
        indexes = {json.loads(line[6:])["index"] for line in whole.data.decode().splitlines()
                   if line.startswith("data: ")}  # fmt: skip
        assert indexes == {index} and whole.data.count(b"event: ") == 3 + (index == 0)
        assert whole.payload == {"type": "tool_use", "index": index}


def call_added(call: str) -> dict[str, Any]:
    item = {"type": "function_call", "id": call, "name": "f", "arguments": ""}
    return {"type": "response.output_item.added", "item": item}


def test_a_responses_call_opened_inside_the_message_goes_out_whole_at_its_own_end() -> None:
    reader = reader_of(ResponsesReader)
    [reader.take(event(e)) for e in response_events("msg_a", 0, 0)]
    args = {"type": "response.function_call_arguments.delta", "item_id": "fc_a", "delta": "{}"}
    assert reader.take(event(call_added("fc_a"))) == reader.take(event(args)) == []
    text_done = {"type": "response.output_text.done", "item_id": "msg_a", "text": ""}
    message_done = {"type": "response.output_item.done", "item": {"type": "message",
                    "id": "msg_a"}}  # fmt: skip
    for payload in (text_done, message_done):
        (finish,) = reader.take(event(payload))  # held: a cut goes on in the message
        assert finish.step is Step.HOLD and finish.data.count(b"event: ") == 1
    call_done = {"type": "response.output_item.done",
                 "item": {"type": "function_call", "id": "fc_a", "arguments": "{}"}}  # fmt: skip
    (whole,) = reader.take(event(call_done))
    assert whole.step is Step.SEND and whole.data.count(b"event: ") == 3


def test_a_continuation_that_adds_a_call_inside_the_merged_message_leaves_it_open() -> None:
    """The leg's own message done closes the client's message: once, not twice."""
    transcript = delivered(ResponsesReader, response_events("msg_a", 0, 0))
    rewriter = ResponsesRewriter(transcript, "", echo=False)
    assert rewriter.rewrite(response_events("msg_b", 0, 0)[1]) == []  # merged
    (added,) = rewriter.rewrite(call_added("fc_b"))
    assert added["item"]["id"] == "fc_b"
    (done,) = rewriter.rewrite({"type": "response.output_item.done",
                                "item": {"type": "message", "id": "msg_b"}})  # fmt: skip
    assert done["item"]["id"] == "msg_a"


def test_a_responses_call_after_its_message_closed_keeps_the_answer_open() -> None:
    """OpenAI's order: the message item is closed before the call's item is added. The
    answer is not over: a stream that ends inside the call is a cut (no end restated),
    and the call goes out whole at its own done, with the message's end before it."""
    reader = reader_of(ResponsesReader)
    [reader.take(event(e)) for e in response_events("msg_a", 0, 0)]
    text_done = {"type": "response.output_text.done", "item_id": "msg_a", "text": ""}
    message_done = {"type": "response.output_item.done", "item": {"type": "message",
                    "id": "msg_a"}}  # fmt: skip
    held = [e for payload in (text_done, message_done) for e in reader.take(event(payload))]
    assert [e.step for e in held] == [Step.HOLD, Step.HOLD]
    assert reader.close() is not None  # the stream's true end here: the text was all
    args = {"type": "response.function_call_arguments.delta", "item_id": "fc_a", "delta": "{"}
    assert reader.take(event(call_added("fc_a"))) == reader.take(event(args)) == []
    assert reader.close() is None  # ended inside the call: cut
    call_done = {"type": "response.output_item.done",
                 "item": {"type": "function_call", "id": "fc_a", "arguments": "{}"}}  # fmt: skip
    (whole,) = reader.take(event(call_done))
    assert whole.step is Step.SEND and whole.data.count(b"event: ") == 3
    assert reader.close() is None  # a restated response would leave the call out
