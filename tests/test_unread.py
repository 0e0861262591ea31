"""A block forwarded unread is read into the transcript at once, from the one typed
decode that found it plain (formats/blocks.py), in every wire format: the transcript is
the one the event-by-event reading of the parsed events gives, on every recorded answer
and on blocks that decode must refuse (read event by event instead). Nothing of a block
is kept to be read later."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from mitmproxy import io

from addon.formats import sse
from addon.formats.chat import ChatReader
from addon.formats.dialect import LegReader, json_object
from addon.formats.messages import MessagesReader
from addon.formats.ollama import OllamaReader
from addon.formats.responses import ResponsesReader
from addon.formats.shape import loads
from addon.formats.transcript import Transcript
from scripts.testbed.sse_source import chunk

RECORDINGS = Path(__file__).resolve().parent.parent / "recordings"


def _recorded_chat_events() -> list[list[bytes]]:
    """Each recorded chat stream's data events, as llama-server wrote them (and the
    addon's stitched ones: every `data: {` event of every recorded chat answer)."""
    streams = []
    for path in sorted(RECORDINGS.glob("*.mitm")):
        with path.open("rb") as file:
            for flow in io.FlowReader(file).stream():
                body = flow.response.content if getattr(flow, "response", None) else None
                if body and b'"chat.completion.chunk"' in body:
                    events = [e + b"\n\n" for e in body.split(b"\n\n") if e.startswith(b"data: {")]
                    streams.append(events)
    return streams


def _state(transcript: Transcript) -> dict:
    return {k: v for k, v in vars(transcript).items() if not k.startswith("_")}


@pytest.mark.parametrize("size", [1, 3, 8])
def test_a_block_read_in_one_decode_reads_as_event_by_event(size: int) -> None:
    """A chat block forwarded unread is read from the one typed decode that found it
    ordinary (Transcript.record_read): the transcript is the one the event-by-event read
    of the parsed chunks gives, on every recorded chat answer (with its token pieces and
    timings), on the stand-in's chunks with ids, and on blocks that decode cannot take
    (read event by event instead)."""
    odd = [
        b'data: {"id":"c","choices":[{"index":0,\ndata: "delta":{"content":" two"}}]}\n\n',
        b'id: 7\ndata: {"id":"c","choices":[{"index":0,"delta":{"content":" x"}}]}\n\n',
        b'data:{"id":"c","choices":[{"index":0,"delta":{"content":" y"}}]}\n\n',
        b'data: {"id":"c","choices":[{"index":0,"delta":{"content":7}}]}\n\n',
        b'data: {"id":"c","choices":[{"index":0\n,"delta":{"content":" z"}}]}\n\n',
    ]
    thinking = [
        b'data: {"choices":[{"delta":{"reasoning":"a","reasoning_content":"a"},'
        b'"token_ids":[5,6]}],"model":null}\n\n',
        b'data: {"choices":[{"delta":{"content":"b"},"token_ids":[7]}]}\n\n',
    ]
    with_ids = [chunk(i, ids=True, timed=True) for i in range(40)]
    streams = [*_recorded_chat_events(), odd, thinking, with_ids]
    assert len(streams) > 10
    read_typed = 0
    for events in streams:
        blocks = [b"".join(events[i : i + size]) for i in range(0, len(events), size)]
        one, other = Transcript(), Transcript()
        for transcript in (one, other):
            transcript.begin_leg("http://127.0.0.1:1", raw_pieces=True)
        reader = ChatReader(one, None, None, "http://127.0.0.1:1")
        for block in blocks:
            if reader.plain(block) is None:
                _read_parsed(block, sse.events, sse.parse, one.record)
            else:
                read_typed += 1
            _read_parsed(block, sse.events, sse.parse, other.record)
            assert _state(one) == _state(other)
    assert read_typed > len(streams)
    assert all(ChatReader(Transcript(), None, None, "x").plain(b) is None for b in odd)


def _read_parsed(block: bytes, events: Callable, parse: Callable, record: Callable) -> None:
    """The event-by-event reading: each event's JSON object parsed whole, recorded."""
    for event in events(block):
        if not isinstance(payload := json_object(event, parse), str):
            record(payload)


SERVER = "http://127.0.0.1:1"
READERS = {
    "/v1/messages": MessagesReader,
    "/v1/responses": ResponsesReader,
    "/api/chat": OllamaReader,
    "/api/generate": OllamaReader,
}


def _recorded_streams(path: str) -> list[list[bytes]]:
    """Each recorded answer to `path` as its events, each with its terminator."""
    cut = b"\n" if path.startswith("/api/") else b"\n\n"
    streams = []
    for recording in sorted(RECORDINGS.glob("*.mitm")):
        with recording.open("rb") as file:
            for flow in io.FlowReader(file).stream():
                response = getattr(flow, "response", None)
                if flow.request.path == path and response and b"\n" in response.content:
                    streams.append([e + cut for e in response.content.split(cut) if e.strip()])
    return streams


ODD = {
    "/v1/messages": [
        b'event: content_block_delta\nid: 7\ndata: {"type":"content_block_delta",'
        b'"index":0,"delta":{"type":"text_delta","text":" a"}}\n\n',
        b'data:{"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
        b'"text":" b"}}\n\n',
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"signature_delta","signature":"c2ln"}}\n\n',
        b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
        b'"message":"Overloaded"}}\n\n',
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":7}}\n\n',
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0\n'
        b',"delta":{"type":"text_delta","text":" z"}}\n\n',
    ],
    "/v1/responses": [
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
        b'"delta":3,"output_index":0}\n\n',
        b'event: response.reasoning_text.delta\ndata: {"type":'
        b'"response.reasoning_text.delta","delta":" r","output_index":0}\n\n',
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
        b'"delta":" d","output_index":0,"error":{"message":"x"}}\n\n',
        b"event: response.output_text.delta\n\n",
    ],
    "/api/chat": [
        b'{"model":"m","message":{"role":"assistant","content":" a"},"done":true}\n',
        b'{"model":"m","message":{"role":"assistant","content":"","tool_calls":[]},"done":false}\n',
        b'{"model":"m","error":"out of memory","done":false}\n',
        b'{"model":"m","message":{"role":"assistant","content":" b"}}\n',
        b'{"model":"m","message":{"content":" c"},"done":false}\n\n',
    ],
}
# What decode takes, where the byte counts before it did not: Messages' events with no
# event line, Ollama's spaced JSON; and a message that is null, a generate line's thinking.
TAKEN = {
    "/v1/messages": [
        b'data: {"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta",'
        b'"thinking":" t"}}\n\n',
    ],
    "/v1/responses": [
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
        b'"delta":" e","output_index":2,"item_id":"msg_1","content_index":0}\n\n',
    ],
    "/api/chat": [
        b'{"model": "m", "message": {"role": "assistant", "content": " s"}, "done": false}\n',
        b'{"model":"m","message":null,"done":false}\n',
    ],
    "/api/generate": [b'{"model":"n","response":" g","thinking":" h","done":false}\n'],
}


@pytest.mark.parametrize("path", list(READERS))
@pytest.mark.parametrize("size", [1, 3, 8])
def test_every_format_reads_a_plain_block_from_its_decode_as_event_by_event(
    path: str, size: int
) -> None:
    """Messages, Responses and Ollama, as chat above: a recorded answer's blocks, read from
    the typed decode where it finds them plain, leave the transcript that reading every
    event parsed leaves (after each block); the odd blocks decode must refuse are refused."""
    make: type = READERS[path]
    ollama = path.startswith("/api/")
    events_of = OllamaReader.events if ollama else sse.events
    parse = loads if ollama else sse.parse
    odd, taken = ODD.get(path, []), TAKEN.get(path, [])
    recorded = _recorded_streams(path)
    streams = [*recorded, odd, taken]
    assert recorded
    read_typed = 0
    for events in streams:
        blocks = [b"".join(events[i : i + size]) for i in range(0, len(events), size)]
        one, other = Transcript(), Transcript()
        for transcript in (one, other):
            transcript.begin_leg(SERVER)
        reader: LegReader = make(one, None, SERVER)
        parsed: LegReader = make(other, None, SERVER)
        for block in blocks:
            if reader.plain(block) is None:
                _read_parsed(block, events_of, parse, reader.record)
            else:
                read_typed += 1
            _read_parsed(block, events_of, parse, parsed.record)
            assert _state(one) == _state(other)
    assert read_typed >= len(recorded) + len(taken)
    for block in odd:
        assert make(Transcript(), None, SERVER).plain(block) is None, block
    for block in taken:
        transcript = Transcript()
        transcript.begin_leg(SERVER)
        assert make(transcript, None, SERVER).plain(block) == block
