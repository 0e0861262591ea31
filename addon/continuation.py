"""What the client has received, and how a later leg continues it seamlessly.

`Transcript` records the delivered answer. `continuation_body` turns the original request
into one that asks the next server to go on from there (assistant prefill, fewer tokens
left). `ChunkRewriter` makes that server's chunks read as part of the same stream: the
first leg's id and created, no second role delta, the echoed prefill removed, usage for
the whole answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from addon.dialect import EchoStrip, prefilled, with_fewer_tokens
from addon.shape import constraint_of, positive_int, text_of

TOKEN_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict")
Piece = tuple[int, bytes]  # a token id and the bytes of its text


@dataclass
class LegUsage:
    server: str
    model: str | None = None
    completion_tokens: int = 0
    prompt_tokens: int | None = None


@dataclass
class Transcript:
    role_sent: bool = False
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)  # reasoning_content deltas
    produced: int = 0  # deltas delivered; llama-server sends one per token
    id: str | None = None
    created: int | None = None
    legs: list[LegUsage] = field(default_factory=list)
    other_parts: set[str] = field(default_factory=set)  # what cannot be replayed: tool calls
    # Each leg's prompt reading as its server timed it: (server, tokens read, ms).
    reads: list[tuple[str, int, float]] = field(default_factory=list)
    # The token ids behind the delivered text, while every leg has reported them.
    ids: list[int] | None = field(default_factory=list)
    id_bytes: bytearray = field(default_factory=bytearray)
    # What a wire format keeps about the stream the client reads (open blocks, item ids).
    wire: dict[str, Any] = field(default_factory=dict)
    _unread: list[tuple[bytes, Callable[[bytes], None]]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning)

    def record_raw(self, block: bytes, read: Callable[[bytes], None]) -> None:
        """Account for a block of events forwarded unread; `settle()` has `read` read it."""
        self._unread.append((block, read))

    def settle(self) -> None:
        for block, read in self._unread:
            read(block)
        self._unread.clear()

    def timed(self, chunk: dict[str, Any]) -> None:
        """A leg's last chunk: how long its server took to read the prompt, if it says."""
        timings = chunk.get("timings")
        if isinstance(timings, dict) and self.legs:
            read, ms = timings.get("prompt_n"), timings.get("prompt_ms")
            if isinstance(read, int) and isinstance(ms, int | float):
                self.reads.append((self.legs[-1].server, read, float(ms)))

    def begin_leg(self, server: str) -> None:
        self.legs.append(LegUsage(server))

    def exact_ids(self) -> list[int] | None:
        """The ids of the delivered answer, when they are known and spell exactly the
        delivered text (a token whose text a server held back fails this: fail closed)."""
        if self.ids is None or bytes(self.id_bytes) != self.text.encode():
            return None
        return self.ids

    def add(self, text: str | None, thought: str | None = None) -> None:
        """Account for one delta of answer text or reasoning the client has received
        (servers here send one per token)."""
        leg = self.legs[-1]
        if text and self.reasoning and not self.content:
            # The tag that closed the reasoning was a token too, with no delta of its own.
            self.produced += 1
            leg.completion_tokens += 1
        if text:
            self.content.append(text)
        if thought:
            self.reasoning.append(thought)
        if text or thought:
            self.produced += 1
            leg.completion_tokens += 1

    def whole_answer_tokens(self, last_leg: Any) -> int:
        """The whole answer's tokens, the last leg's as its server counted them."""
        self.legs[-1].completion_tokens = int(last_leg or 0)
        return sum(leg.completion_tokens for leg in self.legs)

    def record(self, chunk: dict[str, Any], pieces: list[Piece] | None = None) -> None:
        """Account for a chat chunk that has been written to the client; `pieces` are the
        ids behind it (taken from its logprobs when not given)."""
        if self.id is None:
            self.id = chunk.get("id")
            self.created = chunk.get("created")
        leg = self.legs[-1]
        leg.model = chunk.get("model", leg.model)
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("role"):
                self.role_sent = True
            self.add(delta.get("content") or choice.get("text"), delta.get("reasoning_content"))
            if delta.get("tool_calls"):
                self.other_parts.add("tool_calls")
        self._record_ids(chunk, pieces)

    def _record_ids(self, chunk: dict[str, Any], pieces: list[Piece] | None) -> None:
        if self.ids is None:
            return
        if pieces is None:
            pieces = take_pieces(chunk, strip=False)
        if pieces is None:
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("reasoning_content"):
                    self.ids = None  # text without ids: it can only be replayed as text
            return
        for token, data in pieces:
            self.ids.append(token)
            self.id_bytes += data


def take_pieces(chunk: dict[str, Any], strip: bool) -> list[Piece] | None:
    """The token pieces a chat chunk carries in its logprobs (None when it carries none);
    with `strip`, the logprobs are removed from the chunk."""
    pieces: list[Piece | None] | None = None
    for choice in chunk.get("choices") or ():
        logprobs = choice.pop("logprobs", None) if strip else choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            pieces = (pieces or []) + [_piece(entry) for entry in logprobs["content"]]
    known = [piece for piece in pieces or () if piece is not None]
    if pieces is None or len(known) != len(pieces):
        return None  # none, or in a form without ids: the text is what can be replayed
    return known


def _piece(entry: Any) -> Piece | None:
    if not isinstance(entry, dict) or not isinstance(token := entry.get("id"), int):
        return None
    try:
        return token, bytes(entry["bytes"])
    except (KeyError, TypeError, ValueError):
        return None


def continuation_body(original: dict[str, Any], transcript: Transcript) -> dict[str, Any]:
    """The original request, continued from what the client already has."""
    body = with_fewer_tokens(original, transcript.produced, TOKEN_LIMIT_FIELDS)
    delivered, reasoning = transcript.text, transcript.reasoning_text
    if not delivered and not reasoning:
        return body
    if isinstance(body.get("prompt"), str):
        body["prompt"] += delivered  # a text completion simply goes on from its prompt
    else:
        messages = prefilled(list(body.get("messages") or []), delivered, _assistant)
        if reasoning:
            # llama-server goes on with the reasoning while the answer has no content yet,
            # else it renders the reasoning closed and goes on with the content.
            messages[-1]["reasoning_content"] = reasoning
        body["messages"] = messages
    return body


def _assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def token_limit(body: dict[str, Any]) -> int | None:
    """How many tokens the request may still produce, when it says."""
    for name in TOKEN_LIMIT_FIELDS:
        if (limit := positive_int(body.get(name))) is not None:
            return limit
    return None


def cannot_continue(body: dict[str, Any], transcript: Transcript) -> str | None:
    """Why another server cannot honestly continue this answer, or None when it can.
    Before any text went out, any server can simply answer from the start."""
    if transcript.other_parts:
        parts = " and ".join(sorted(transcript.other_parts))
        return f"the answer so far has {parts}, which cannot be continued elsewhere"
    if not transcript.content:
        return None
    if (constraint := constraint_of(body)) is not None:
        return f"the answer is bound by {constraint}, which another server would start over"
    if _prefill_message(body) is not None and prefill_of(body) is None:
        return "the client's assistant prefill is not plain text"
    return None


def _prefill_message(body: dict[str, Any]) -> dict[str, Any] | None:
    messages = body.get("messages")
    if isinstance(messages, list) and messages and messages[-1].get("role") == "assistant":
        return messages[-1]
    return None


def prefill_of(body: dict[str, Any]) -> str | None:
    """The text of the client's own assistant prefill ("" without one; None when it is
    not plain text)."""
    message = _prefill_message(body)
    return "" if message is None else text_of(message.get("content"))


class ChunkRewriter:
    """Rewrites one continuation leg's chunks to fit the stream the client is reading.

    `echo` says whether the server repeats the prefill at the start of its answer:
    True or False when known (probed), None to decide from the first content delta.
    Reasoning is echoed like content; once the answer has moved on to content, the
    server restates the finished reasoning, which is dropped whole.
    """

    def __init__(self, transcript: Transcript, prefill: str, echo: bool | None) -> None:
        self._transcript = transcript
        self._echo = {
            "content": EchoStrip(prefill, echo),
            "reasoning_content": EchoStrip(transcript.reasoning_text, echo),
        }
        self._reasoning_done = bool(transcript.reasoning and transcript.content)

    def rewrite(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """The chunk as the client should see it, or None when nothing is left of it."""
        transcript = self._transcript
        if transcript.id is not None:
            chunk["id"] = transcript.id
            chunk["created"] = transcript.created
        choices = chunk.get("choices")
        if not choices:
            if chunk.get("usage"):
                chunk["usage"] = self._whole_answer_usage(chunk["usage"])
            return chunk
        keep = False
        for choice in choices:
            delta = choice.get("delta") or {}
            if delta.get("role") and transcript.role_sent:
                del delta["role"]
                if delta.get("content") is None:
                    delta.pop("content", None)
            if self._reasoning_done:
                delta.pop("reasoning_content", None)
            for part in ("content", "reasoning_content"):
                if delta.get(part):
                    delta[part] = self._echo[part](delta[part])
                    if not delta[part]:
                        del delta[part]
            if delta or choice.get("text") or choice.get("finish_reason") is not None:
                keep = True
        if chunk.get("usage"):
            chunk["usage"] = self._whole_answer_usage(chunk["usage"])
            keep = True
        return chunk if keep else None

    def _whole_answer_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """Usage for the whole answer: every leg's completion tokens, and the prompt the
        last leg read (the original prompt plus the replayed answer), leg by leg too."""
        legs = self._transcript.legs
        legs[-1].prompt_tokens = usage.get("prompt_tokens")
        completion = self._transcript.whole_answer_tokens(usage.get("completion_tokens"))
        prompt = int(usage.get("prompt_tokens") or 0)
        return {
            **usage,
            "completion_tokens": completion,
            "prompt_tokens": prompt,
            "total_tokens": completion + prompt,
            "spillover": {"legs": [dataclasses.asdict(leg) for leg in legs]},
        }
