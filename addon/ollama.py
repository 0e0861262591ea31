"""Ollama chat streams (/api/chat): newline-delimited JSON, one object per line.

Each line carries a piece of the assistant's message; the last has `done: true`, the
stop reason and the counts. A stream has no comment lines, so the client is told of a
handoff only in the flow's metadata, `/spillover/status` and the log. A continuation asks
the next server for the same chat with the answer so far as a partial assistant message
(which Ollama continues) and fewer tokens to go (`options.num_predict`); its lines join
the client's stream with its last line counting the whole answer (`eval_count`).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from addon.continuation import Transcript
from addon.dialect import (
    EchoStrip,
    Event,
    Rewriter,
    Step,
    has_messages,
    json_object,
    prefilled,
    read_payloads,
)
from addon.shape import mapping, positive_int, text_of
from addon.sse import MAX_EVENT_BYTES, EventTooLarge

NL = b"\n"
JSON = [(b"content-type", b"application/json; charset=utf-8")]


class LineSplitter:
    """Cuts a byte stream after its last complete line; the rest waits for more."""

    def __init__(self, limit: int = MAX_EVENT_BYTES) -> None:
        self._pending = b""
        self._limit = limit

    def feed(self, data: bytes) -> bytes:
        data = self._pending + data
        end = data.rfind(NL) + 1
        block, self._pending = data[:end], data[end:]
        if len(self._pending) > self._limit:
            raise EventTooLarge(f"a line over {self._limit} bytes")
        return block


def encode(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + NL


class OllamaReader:
    boundary = NL
    splitter = LineSplitter

    def __init__(self, transcript: Transcript, rewriter: Rewriter | None, server: str) -> None:
        self.transcript = transcript
        self.rewriter = rewriter
        self.server = server

    @staticmethod
    def events(block: bytes) -> list[bytes]:
        return [line for line in block.split(NL) if line.strip()]

    def plain(self, block: bytes) -> bool:
        """Only pieces of text: lines that are not the last, no error, no tool call."""
        return (
            self.rewriter is None
            and block.count(b'"done":false') == block.count(NL)
            and b'"error"' not in block
            and b'"tool_calls"' not in block
        )

    def take(self, event: bytes) -> list[Event] | str:
        payload = json_object(event, json.loads)
        if isinstance(payload, str):
            return f"garbled line from {self.server}: {payload}"
        if "error" in payload:
            return f"in-band error from {self.server}: {payload['error']}"
        data = event.rstrip(b"\r") + NL
        if self.rewriter is not None:
            payload = self.rewriter.rewrite(payload)
            if payload is None:
                return []
            data = encode(payload)
        if payload.get("done") is True:
            return [Event(Step.END, data)]
        return [Event(Step.SEND, data, payload)]

    def record(self, payload: dict[str, Any]) -> None:
        message = mapping(payload.get("message"))
        self.transcript.legs[-1].model = payload.get("model")
        self.transcript.add(message.get("content"), message.get("thinking"))
        if message.get("tool_calls"):
            self.transcript.other_parts.add("tool calls")

    def read_block(self, block: bytes) -> None:
        read_payloads(self.events(block), json.loads, self.record)

    def close(self) -> bytes | None:
        return None  # the last line is the answer's end: a stream without it is cut


class OllamaRewriter:
    def __init__(self, transcript: Transcript, prefill: str, echo: bool | None) -> None:
        self._transcript = transcript
        self._echo = EchoStrip(prefill, echo)

    def rewrite(self, payload: dict[str, Any]) -> dict[str, Any] | None:
        message = mapping(payload.get("message"))
        if message.get("content"):
            message["content"] = self._echo(message["content"])
        if payload.get("done") is True:
            legs = self._transcript.legs
            legs[-1].completion_tokens = int(payload.get("eval_count") or 0)
            payload["eval_count"] = sum(leg.completion_tokens for leg in legs)
            return payload
        said = any(message.get(k) for k in ("content", "thinking", "tool_calls"))
        return payload if said else None


def _assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


class Ollama:
    name = "ollama"
    sizes_rooms = False
    pins_slots = False

    def accepts(self, body: dict[str, Any]) -> bool:
        return has_messages(body)

    def streaming(self, body: dict[str, Any]) -> bool:
        return body.get("stream") is not False  # Ollama streams unless told not to

    def reader(
        self, transcript: Transcript, rewriter: Rewriter | None, strip_pieces: bool, server: str
    ) -> OllamaReader:
        return OllamaReader(transcript, rewriter, server)

    def note(self, text: str) -> None:
        return None

    def error_end(self, message: str) -> bytes:
        return encode({"error": message})

    def refusal(self, message: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
        return JSON, json.dumps({"error": message}).encode()

    def cannot_continue(self, body: dict[str, Any], transcript: Transcript) -> str | None:
        if transcript.other_parts:
            return "the answer so far has a tool call, which cannot be continued elsewhere"
        if transcript.reasoning:
            return "the answer so far has thinking, which is not carried in an Ollama stream"
        if body.get("format"):
            return "the answer is bound by format, which another server would start over"
        last = (body.get("messages") or [{}])[-1]
        if last.get("role") == "assistant" and text_of(last.get("content")) is None:
            return "the client's assistant prefill is not plain text"
        return None

    def continuation(self, body: dict[str, Any], transcript: Transcript) -> dict[str, Any]:
        body = copy.deepcopy(body)
        options = body.get("options")
        if isinstance(options, dict) and (limit := positive_int(options.get("num_predict"))):
            options["num_predict"] = max(1, limit - transcript.produced)
        if transcript.text:
            body["messages"] = prefilled(body["messages"], transcript.text, _assistant)
        return body

    def rewriter(
        self, transcript: Transcript, continuation: dict[str, Any], echo: bool | None
    ) -> OllamaRewriter:
        last = continuation["messages"][-1]
        prefill = last.get("content") if last.get("role") == "assistant" else ""
        return OllamaRewriter(transcript, prefill or "", echo)
