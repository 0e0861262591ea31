"""Chunks forwarded unread are read in order, the oldest once more than UNREAD_BYTES of
them wait: an open answer holds a bounded share of its raw bytes, not all of them, and
reads them a block at a time (answers streaming in step never all read 64 KiB at once).
A chunk taken one by one after them (an answer's last token, beside its end) waits its
turn: ending an answer reads nothing it left unread."""

from __future__ import annotations

from pathlib import Path

import pytest
from mitmproxy import io

from addon.formats import sse
from addon.formats.chat import ChatReader
from addon.formats.dialect import read_payloads
from addon.formats.transcript import UNREAD_BYTES, Transcript
from scripts.testbed.sse_source import chunk

RECORDINGS = Path(__file__).resolve().parent.parent / "recordings"


def test_blocks_are_read_in_order_once_enough_wait() -> None:
    transcript, read = Transcript(), []
    block = b"x" * 1000
    for index in range(200):
        before = len(read)
        transcript.record_raw(block + str(index).encode(), lambda b: read.append(b[1000:]))
        assert sum(size for _, _, size in transcript._unread) <= UNREAD_BYTES
        assert len(read) - before <= 1
    assert read and read == [str(i).encode() for i in range(len(read))]
    transcript.settle()
    assert read == [str(i).encode() for i in range(200)]


def _chunk(text: str) -> dict:
    return {"id": "c", "choices": [{"index": 0, "delta": {"content": text}}]}


def test_a_chunk_taken_after_unread_blocks_waits_its_turn() -> None:
    transcript, reads = Transcript(), []
    transcript.begin_leg("http://127.0.0.1:1")

    def read(block: bytes) -> None:
        reads.append(block)
        transcript.record(_chunk(block.decode()))

    for word in ("one", " two"):
        transcript.record_raw(word.encode(), read)
    transcript.record_in_turn((_chunk(" three"), None))
    assert reads == [] and transcript.text == ""  # nothing read at the answer's end
    transcript.settle()
    assert transcript.text == "one two three" and transcript.produced == 3
    transcript.record_in_turn((_chunk(" four"),))  # nothing waits: recorded at once
    assert transcript.text == "one two three four"


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
                read_payloads(sse.events(block), sse.parse, one.record)
            else:
                read_typed += 1
            read_payloads(sse.events(block), sse.parse, other.record)
            assert _state(one) == _state(other)
    assert read_typed > len(streams)
    assert all(ChatReader(Transcript(), None, None, "x").plain(b) is None for b in odd)
