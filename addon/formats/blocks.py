"""What the hot path reads of a block of events, in one typed decode per wire format:
msgspec reads the few fields named here and skips the rest of each event unparsed
(0.9-1.5 us for a llama-server token chunk, where scanning its bytes once per marker
took 2.2-2.7).

A block whose events are all ordinary pieces of the answer goes to the client unread
(chat's with the ids the addon asked for cut out of its bytes: formats/pieces.py), and
the transcript takes what it keeps from the same decode, at once; anything else, or
anything msgspec will not read, goes event by event through its format's reader, which
has the last word on it.
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


# What a block msgspec will not read raises: not this framing (ValueError), another type
# or shape, nesting too deep. The block then goes event by event.
_REFUSED = (ValueError, msgspec.MsgspecError, RecursionError)
_CHUNKS = msgspec.json.Decoder(list[Chunk])


def chunks_of(block: bytes) -> list[Chunk] | None:
    """The chunks of a block of one-line `data: {...}` events; None for anything else."""
    try:
        return _CHUNKS.decode(sse.as_array(block))
    except _REFUSED:
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


class MessagesDelta(msgspec.Struct, gc=False):
    type: str
    text: str | None = None
    thinking: str | None = None


# A struct with a tag reads only events of that type: any other fails the decode.
class MessagesEvent(msgspec.Struct, gc=False, tag_field="type", tag="content_block_delta"):
    delta: MessagesDelta
    error: msgspec.Raw = msgspec.Raw()


_MESSAGES = msgspec.json.Decoder(list[MessagesEvent])
_MESSAGES_DELTAS = ("text_delta", "thinking_delta")


def messages_deltas(block: bytes) -> list[MessagesDelta] | None:
    """The deltas of a block of Anthropic Messages events when every one is a piece of
    text or of thinking (`content_block_delta`); None otherwise."""
    try:
        events = _MESSAGES.decode(sse.named_as_array(block, b"content_block_delta"))
    except _REFUSED:
        return None
    if any(e.delta.type not in _MESSAGES_DELTAS or e.error for e in events):
        return None
    return [event.delta for event in events]


class ResponsesDelta(msgspec.Struct, gc=False, tag_field="type", tag="response.output_text.delta"):
    delta: str
    sequence_number: Any = msgspec.UNSET  # (UNSET: not written)
    output_index: Any = None
    error: msgspec.Raw = msgspec.Raw()


_RESPONSES = msgspec.json.Decoder(list[ResponsesDelta])


def responses_deltas(block: bytes) -> list[ResponsesDelta] | None:
    """The events of a block of OpenAI Responses events when every one is a piece of the
    answer's text (`response.output_text.delta`); None otherwise."""
    try:
        events = _RESPONSES.decode(sse.named_as_array(block, b"response.output_text.delta"))
    except _REFUSED:
        return None
    return None if any(event.error for event in events) else events


class OllamaMessage(msgspec.Struct, gc=False):
    content: str | None = None
    thinking: str | None = None
    tool_calls: msgspec.Raw = msgspec.Raw()


class OllamaLine(msgspec.Struct, gc=False):
    done: bool
    model: Any = None
    message: OllamaMessage | msgspec.UnsetType | None = msgspec.UNSET  # a chat line's
    response: str | None = None  # a generate line's
    thinking: str | None = None
    error: msgspec.Raw = msgspec.Raw()


_OLLAMA = msgspec.json.Decoder(list[OllamaLine])


def ollama_pieces(block: bytes) -> list[OllamaLine] | None:
    """The lines of a block of Ollama's, when none is the last (`done`), an error or a
    tool call; None otherwise."""
    if not block.endswith(b"\n"):
        return None
    try:
        # A line's JSON holds no raw newline, so each one parts two lines (an empty
        # line gives no valid JSON).
        lines = _OLLAMA.decode(b"[" + block[:-1].replace(b"\n", b",") + b"]")
    except _REFUSED:
        return None
    for line in lines:
        if line.done or line.error or (line.message and line.message.tool_calls):
            return None
    return lines
