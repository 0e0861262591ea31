"""Anthropic Messages streams (/v1/messages), what coding agents built for Claude speak.

The stream is one message of content blocks: `message_start`, then for each block a
`content_block_start`, its deltas and a `content_block_stop`, then `message_delta` (the
stop reason, usage) and `message_stop`. A continuation asks the next server for the same
message with the answer so far as a partial assistant turn, and its events join the
client's stream: no second `message_start`, its first block merged into the block the
client has open (or that block closed first, when the next server starts another kind),
block indexes shifted to follow the client's, one `message_delta` with the whole answer's
usage, one `message_stop`. A tool_use block goes out whole, like a chat tool call
(formats/heldcalls.py). Thinking carries over as in chat: cut while thinking, the next
server goes on with the thinking block; cut after the text began, its restatement of the
thinking is dropped.
"""

from __future__ import annotations

import json
from typing import Any

from addon.formats import sse
from addon.formats.blocks import messages_deltas
from addon.formats.continuation import bound_by, token_limit
from addon.formats.dialect import (
    EchoStrip,
    Event,
    Rewriter,
    Step,
    has_messages,
    prefilled,
    unknown_echo,
    with_fewer_tokens,
)
from addon.formats.heldcalls import HeldCalls, messages_part
from addon.formats.shape import text_of
from addon.formats.sizes import bound
from addon.formats.transcript import Transcript
from addon.formats.typedsse import TypedEventReader, encode
from addon.formats.wire import Header, error_text

SEP = sse.TERMINATOR
JSON = [(b"content-type", b"application/json")]


class MessagesReader(TypedEventReader):
    def __init__(self, transcript: Transcript, rewriter: Rewriter | None, server: str) -> None:
        super().__init__(transcript, rewriter, server)
        self._tools = HeldCalls()  # a new leg starts with no tool block's events: cut ones dropped
        self._finished = False

    def plain(self, block: bytes) -> bytes | None:
        """Only text and thinking deltas, which nothing but the transcript needs to read
        (read from the decode that found them so)."""
        if self.rewriter is not None or self._tools.open:
            return None
        if (deltas := messages_deltas(block)) is None:
            return None
        for delta in deltas:
            self.transcript.add(delta.text, delta.thinking)
        return block

    def failure(self, payload: dict[str, Any]) -> str | None:
        if payload.get("type") == "error" or ("error" in payload and "type" not in payload):
            return error_text(payload.get("error"))
        return None

    def sort(self, payload: dict[str, Any], data: bytes) -> list[Event]:
        kind = payload.get("type")
        if kind == "message_stop":
            return [Event(Step.END, data)]
        if self._finished or kind == "message_delta":
            self._finished = True
            return [Event(Step.FINISH, data)]
        if (tool := self._tools.take(messages_part(payload), data)) is not None:
            whole = {"type": "tool_use", "index": payload.get("index")}
            return [Event(Step.SEND, b"".join(tool), whole)] if tool else []
        if kind == "content_block_stop":
            return [Event(Step.HOLD, data, payload)]
        return [Event(Step.SEND, data, payload)]

    def record(self, payload: dict[str, Any]) -> None:
        transcript, kind = self.transcript, payload.get("type")
        if kind == "content_block_delta":
            delta = payload.get("delta") or {}
            transcript.add(delta.get("text"), delta.get("thinking"))
        elif kind == "content_block_start":
            block = payload.get("content_block") or {}
            transcript.wire["block"] = (payload.get("index"), block.get("type"))
            self._count_block(payload.get("index"))
        elif kind == "content_block_stop":
            transcript.wire.pop("block", None)
        elif kind == "tool_use":
            transcript.other_parts.add("tool calls")
            self._count_block(payload.get("index"))
        elif kind == "message_start":
            message = payload.get("message") or {}
            transcript.legs[-1].model = message.get("model")
            if transcript.id is None:
                transcript.id = message.get("id")

    def _count_block(self, index: Any) -> None:
        if isinstance(index, int):
            self.transcript.wire["blocks"] = index + 1

    def close(self) -> bytes | None:
        return encode({"type": "message_stop"}) if self._finished else None


class MessagesRewriter:
    """A continuation leg's events as the rest of the client's message."""

    def __init__(self, transcript: Transcript, prefill: str, echo: bool | None) -> None:
        self._transcript = transcript
        self._echo = {
            "text_delta": ("text", EchoStrip(prefill, echo)),
            "thinking_delta": ("thinking", EchoStrip(transcript.reasoning_text, echo)),
        }
        self._open = transcript.wire.get("block")  # (index, type) of the client's open block
        self._shift: int | None = None  # from this leg's block indexes to the client's
        self._merged: int | None = None  # this leg's block that continues the open one
        self._dropped: int | None = None  # this leg's restatement of finished thinking

    def rewrite(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        kind = payload.get("type")
        if kind == "message_start" and self._transcript.id is not None:
            return []  # the client has its message
        index = payload.get("index")
        out: list[dict[str, Any]] = []
        if index is not None and index == self._dropped:
            return []
        if kind == "content_block_start" and self._shift is None and isinstance(index, int):
            block_type = (payload.get("content_block") or {}).get("type")
            if block_type == "thinking" and self._transcript.content:
                self._dropped = index  # the thinking the client has whole, restated
                return []
            if self._open is None:
                self._shift = self._next_index() - index
            elif block_type == self._open[1]:
                self._shift, self._merged = self._open[0] - index, index
                return []  # the client's open block goes on
            else:
                out.append({"type": "content_block_stop", "index": self._open[0]})
                self._shift = self._open[0] + 1 - index
        if isinstance(index, int) and self._shift is not None:
            payload["index"] = index + self._shift
        if kind == "content_block_delta" and index == self._merged:
            delta = payload.get("delta") or {}
            if (echo := self._echo.get(delta.get("type"))) is not None:
                field, strip = echo
                delta[field] = strip(delta.get(field) or "")
                if not delta[field]:
                    return out
        if kind == "message_delta":
            payload["usage"] = self._whole_answer_usage(payload.get("usage") or {})
        return [*out, payload]

    def _next_index(self) -> int:
        return int(self._transcript.wire.get("blocks", 0))

    def _whole_answer_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        whole = self._transcript.whole_answer_tokens(usage.get("output_tokens"))
        return {**usage, "output_tokens": whole}


def _assistant(text: str, thought: str) -> dict[str, Any]:
    thinking = [{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []
    texts = [{"type": "text", "text": text}] if text else []
    return {"role": "assistant", "content": [*thinking, *texts]}


class Messages:
    name = "messages"
    sizes_rooms = False
    shadowed = False

    def accepts(self, body: dict[str, Any]) -> bool:
        return has_messages(body)

    def streaming(self, body: dict[str, Any]) -> bool:
        return body.get("stream") is True

    def limit(self, body: dict[str, Any]) -> int | None:
        return token_limit(body)

    def upper_bound(self, body: dict[str, Any]) -> int | None:
        if body.get("tools"):
            return None
        turns = [[m.get("content")] if isinstance(m, dict) else None for m in body["messages"]]
        return bound([[body.get("system")], *turns], self.limit(body))

    def reader(
        self,
        transcript: Transcript,
        rewriter: Rewriter | None,
        strip_pieces: str | None,
        server: str,
    ) -> MessagesReader:
        return MessagesReader(transcript, rewriter, server)

    def note(self, text: str) -> bytes:
        return sse.comment(text) + SEP

    def error_end(self, message: str) -> bytes:
        return encode({"type": "error", "error": {"type": "overloaded_error", "message": message}})

    def refusal(self, message: str) -> tuple[list[Header], bytes]:
        body = {"type": "error", "error": {"type": "api_error", "message": message}}
        return JSON, json.dumps(body).encode()

    def continues_a_turn(self, body: dict[str, Any]) -> bool:
        return True

    def cannot_continue(self, body: dict[str, Any], transcript: Transcript) -> str | None:
        if transcript.other_parts:
            return "the answer so far has a tool call, which cannot be continued elsewhere"
        if transcript.content and (why := bound_by(body)) is not None:
            return why
        last = (body.get("messages") or [{}])[-1]
        assistant = isinstance(last, dict) and last.get("role") == "assistant"
        if assistant and text_of(last.get("content")) is None:
            return "the client's assistant prefill is not plain text"
        return unknown_echo(transcript)

    def continuation(self, body: dict[str, Any], transcript: Transcript) -> dict[str, Any]:
        body = with_fewer_tokens(body, transcript.produced, ("max_tokens",))
        thought = transcript.reasoning_text
        if transcript.text or thought:
            message = lambda text: _assistant(text, thought)  # noqa: E731
            echoed = transcript.prefill_echoed
            body["messages"] = prefilled(body["messages"], transcript.text, echoed, message)
        return body

    def leg_path(self, path: str, continuation: dict[str, Any]) -> str:
        return path

    def rewriter(
        self, transcript: Transcript, continuation: dict[str, Any], echo: bool | None
    ) -> MessagesRewriter:
        last, prefill = continuation["messages"][-1], ""
        if last.get("role") == "assistant" and isinstance(content := last.get("content"), list):
            prefill = text_of([p for p in content if p.get("type") == "text"]) or ""
        elif last.get("role") == "assistant":
            prefill = text_of(last.get("content")) or ""
        return MessagesRewriter(transcript, prefill, echo)
