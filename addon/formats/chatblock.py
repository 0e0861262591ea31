"""What the hot path reads of a block of chat chunks, in one typed decode: msgspec reads
the few fields named here and skips the rest of each chunk unparsed (0.9-1.5 us for a
llama-server token chunk, where scanning its bytes once per marker took 2.2-2.7).

A block whose chunks are all ordinary token chunks goes to the client unread (with the
ids the addon asked for cut out of its bytes: formats/pieces.py), and the transcript
takes what it keeps from the same decode (Transcript.record_read); anything else, or
anything msgspec will not read, goes event by event through the chat reader, which has
the last word on it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from addon.formats import sse


# gc=False: a decoded chunk refers to nothing that refers back to it, so it is never in a
# cycle; untracked, the thousands made a second do not drive the collector's passes.
class Delta(msgspec.Struct, gc=False):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None  # llama-server's reasoning
    reasoning: str | None = None  # vLLM's
    tool_calls: msgspec.Raw = msgspec.Raw()

    @property
    def thought(self) -> str | None:
        """Its reasoning, in whichever field its server writes it (a build that writes
        both writes the same text in each)."""
        return self.reasoning_content or self.reasoning


NO_DELTA = Delta()


class Choice(msgspec.Struct, gc=False):
    finish_reason: str | None = None
    delta: Delta | None = None
    text: str | None = None  # a text completion's
    # Raw: where it lies in the bytes, decoded only when the transcript reads it.
    logprobs: msgspec.Raw = msgspec.Raw()
    token_ids: msgspec.Raw = msgspec.Raw()


class Chunk(msgspec.Struct, gc=False):
    id: Any = None
    created: Any = None
    model: Any = msgspec.UNSET  # (UNSET: not written; null is written)
    choices: list[Choice] = []
    error: msgspec.Raw = msgspec.Raw()
    usage: msgspec.Raw = msgspec.Raw()
    timings: msgspec.Raw = msgspec.Raw()
    prompt_token_ids: msgspec.Raw = msgspec.Raw()


_CHUNKS = msgspec.json.Decoder(list[Chunk])


def chunks_of(block: bytes) -> list[Chunk] | None:
    """The chunks of a block of one-line `data: {...}` events; None for anything else."""
    try:
        return _CHUNKS.decode(sse.as_array(block))
    except (ValueError, msgspec.MsgspecError, RecursionError):
        return None


def ordinary_chunks(block: bytes) -> list[Chunk] | None:
    """The block's chunks when every one is an ordinary token chunk: one that neither ends
    the answer (a finish reason, usage), reports an error nor carries a piece of a tool
    call (a `tool_calls` field at all, even empty); None otherwise."""
    chunks = chunks_of(block)
    if chunks is None:
        return None
    for chunk in chunks:
        if chunk.error or chunk.usage:
            return None
        for choice in chunk.choices:
            if choice.finish_reason is not None or (choice.delta and choice.delta.tool_calls):
                return None
    return chunks
