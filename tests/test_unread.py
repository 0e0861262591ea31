"""Chunks forwarded unread are read in order, the oldest once more than UNREAD_BYTES of
them wait: an open answer holds a bounded share of its raw bytes, not all of them, and
reads them a block at a time (answers streaming in step never all read 64 KiB at once)."""

from __future__ import annotations

from addon.formats.transcript import UNREAD_BYTES, Transcript


def test_blocks_are_read_in_order_once_enough_wait() -> None:
    transcript, read = Transcript(), []
    block = b"x" * 1000
    for index in range(200):
        before = len(read)
        transcript.record_raw(block + str(index).encode(), lambda b: read.append(b[1000:]))
        assert sum(len(b) for b, _ in transcript._unread) <= UNREAD_BYTES
        assert len(read) - before <= 1
    assert read and read == [str(i).encode() for i in range(len(read))]
    transcript.settle()
    assert read == [str(i).encode() for i in range(200)]
