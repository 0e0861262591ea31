"""Chunks forwarded unread are read in order, the oldest once more than UNREAD_BYTES of
them wait: an open answer holds a bounded share of its raw bytes, not all of them, and
reads them a block at a time (answers streaming in step never all read 64 KiB at once).
A chunk taken one by one after them (an answer's last token, beside its end) waits its
turn: ending an answer reads nothing it left unread."""

from __future__ import annotations

from addon.formats.transcript import UNREAD_BYTES, Transcript


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
