"""Chunks forwarded unread are read in order, at the latest once UNREAD_BYTES of them
wait: an open answer holds a bounded share of its raw bytes, not all of them."""

from __future__ import annotations

from addon.formats.transcript import UNREAD_BYTES, Transcript


def test_blocks_are_read_in_order_once_enough_wait() -> None:
    transcript, read = Transcript(), []
    block = b"x" * 1000
    for index in range(200):
        transcript.record_raw(block + str(index).encode(), lambda b: read.append(b[1000:]))
        assert sum(len(b) for b, _ in transcript._unread) <= UNREAD_BYTES + len(block) + 3
    assert read and read == [str(i).encode() for i in range(len(read))]
    transcript.settle()
    assert read == [str(i).encode() for i in range(200)]
