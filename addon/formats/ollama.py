"""Ollama streams (/api/chat, /api/generate): newline-delimited JSON, one object a line.

Each line carries a piece of the answer (`message` for chat, `response` for generate);
the last has `done: true`, the stop reason and the counts. A stream has no comment lines,
so the client is told of a handoff only in the flow's metadata, `/spillover/status` and
the log. A continuation asks the next server for the same chat with the answer so far as
a partial assistant message (which Ollama continues) and fewer tokens to go
(`options.num_predict`); its lines join the client's stream with its last line counting
the whole answer (`eval_count`). A generate request is continued as the chat Ollama
itself renders it from (its `system` and `prompt` as messages) and the chat's lines are
written as generate lines; a `raw` one goes on from its own prompt. After a handoff the
last generate line has no `context`: the next server's tokens would make it wrong.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from msgspec import UNSET

from addon.formats.blocks import ollama_pieces
from addon.formats.continuation import bound_by
from addon.formats.dialect import (
    EchoStrip,
    Event,
    Garbled,
    Rewriter,
    Step,
    has_messages,
    json_object,
    prefilled,
    unknown_echo,
)
from addon.formats.shape import loads, mapping, positive_int, text_of
from addon.formats.sizes import bound
from addon.formats.sse import MAX_EVENT_BYTES, EventTooLarge
from addon.formats.transcript import Transcript

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
        if not block and len(self._pending) > self._limit:
            raise EventTooLarge(f"a line over {self._limit} bytes")
        return block  # a rest over the limit is found by the next call, which keeps its data

    def rest(self) -> bytes:
        return self._pending


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

    def plain(self, block: bytes) -> bytes | None:
        """Only pieces of the answer: lines that are not the last, no error, no tool call
        (read from the decode that found them so)."""
        if self.rewriter is not None or (lines := ollama_pieces(block)) is None:
            return None
        transcript = self.transcript
        for line in lines:
            transcript.legs[-1].model = line.model
            if line.message is UNSET:  # a generate line
                transcript.add(line.response, line.thinking)
            elif line.message is not None:
                transcript.add(line.message.content, line.message.thinking)
        return block

    def take(self, event: bytes) -> list[Event] | str:
        payload = json_object(event, loads)
        if isinstance(payload, str):
            return Garbled(f"garbled line from {self.server}: {payload}")
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
        self.transcript.legs[-1].model = payload.get("model")
        if "message" not in payload:  # a generate line
            self.transcript.add(payload.get("response"), payload.get("thinking"))
            return
        message = mapping(payload.get("message"))
        self.transcript.add(message.get("content"), message.get("thinking"))
        if message.get("tool_calls"):
            self.transcript.other_parts.add("tool calls")

    def close(self) -> bytes | None:
        return None  # the last line is the answer's end: a stream without it is cut


class OllamaRewriter:
    """A continuation leg's lines as the rest of the client's stream; `as_generate`: the
    client asked /api/generate and this leg is the chat it was continued as."""

    def __init__(
        self, transcript: Transcript, prefill: str, echo: bool | None, as_generate: bool
    ) -> None:
        self._transcript = transcript
        self._echo = EchoStrip(prefill, echo)
        self._as_generate = as_generate

    def rewrite(self, payload: dict[str, Any]) -> dict[str, Any] | None:
        message = payload.get("message")
        said = message if isinstance(message, dict) else payload
        text = "content" if isinstance(message, dict) else "response"
        if said.get(text):
            said[text] = self._echo(said[text])
        if payload.get("done") is True:
            counted = payload.get("eval_count")
            payload["eval_count"] = self._transcript.whole_answer_tokens(counted)
        elif not any(said.get(k) for k in (text, "thinking", "tool_calls")):
            return None
        return _as_generate(payload) if self._as_generate and message is not None else payload


def _as_generate(line: dict[str, Any]) -> dict[str, Any]:
    """A chat line as the generate line Ollama would have written."""
    message = mapping(line.pop("message", None))
    out = {k: line.pop(k) for k in ("model", "created_at") if k in line}
    out["response"] = message.get("content") or ""
    if message.get("thinking"):
        out["thinking"] = message["thinking"]
    return {**out, **line}


def _assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def _predicted(body: dict[str, Any]) -> int | None:
    """The most tokens the request may write (`options.num_predict`), when it says."""
    options = body.get("options")
    return positive_int(options.get("num_predict")) if isinstance(options, dict) else None


def with_fewer_predicted(body: dict[str, Any], produced: int) -> dict[str, Any]:
    body = copy.deepcopy(body)
    if (limit := _predicted(body)) is not None:
        body["options"]["num_predict"] = max(1, limit - produced)
    return body


class Ollama:
    name = "ollama"
    sizes_rooms = False
    shadowed = False

    def accepts(self, body: dict[str, Any]) -> bool:
        return has_messages(body)

    def streaming(self, body: dict[str, Any]) -> bool:
        return body.get("stream") is not False  # Ollama streams unless told not to

    def limit(self, body: dict[str, Any]) -> int | None:
        return _predicted(body)

    def upper_bound(self, body: dict[str, Any]) -> int | None:
        if body.get("tools"):
            return None
        turns = [
            None if not isinstance(m, dict) or m.get("images") or m.get("tool_calls") else
            [m.get("content"), m.get("thinking")]
            for m in body["messages"]
        ]  # fmt: skip
        return bound(turns, self.limit(body))

    def reader(
        self,
        transcript: Transcript,
        rewriter: Rewriter | None,
        strip_pieces: str | None,
        server: str,
    ) -> OllamaReader:
        return OllamaReader(transcript, rewriter, server)

    def note(self, text: str) -> None:
        return None

    def error_end(self, message: str) -> bytes:
        return encode({"error": message})

    def refusal(self, message: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
        return JSON, json.dumps({"error": message}).encode()

    def continues_a_turn(self, body: dict[str, Any]) -> bool:
        # Ollama continues a trailing assistant message (its documentation says so); its
        # servers answer neither check of servers/proof.py, so they are not held to one.
        return False

    def cannot_continue(self, body: dict[str, Any], transcript: Transcript) -> str | None:
        if transcript.other_parts:
            return "the answer so far has a tool call, which cannot be continued elsewhere"
        if transcript.reasoning:
            return "the answer so far has thinking, which is not carried in an Ollama stream"
        if transcript.content and (why := bound_by(body)) is not None:
            return why
        last = (body.get("messages") or [{}])[-1]
        if last.get("role") == "assistant" and text_of(last.get("content")) is None:
            return "the client's assistant prefill is not plain text"
        return unknown_echo(transcript)

    def continuation(self, body: dict[str, Any], transcript: Transcript) -> dict[str, Any]:
        body = with_fewer_predicted(body, transcript.produced)
        if transcript.text:
            echoed = transcript.prefill_echoed
            body["messages"] = prefilled(body["messages"], transcript.text, echoed, _assistant)
        return body

    def leg_path(self, path: str, continuation: dict[str, Any]) -> str:
        return path

    def rewriter(
        self, transcript: Transcript, continuation: dict[str, Any], echo: bool | None
    ) -> OllamaRewriter:
        last = continuation["messages"][-1]
        prefill = last.get("content") if last.get("role") == "assistant" else ""
        return OllamaRewriter(transcript, prefill or "", echo, as_generate=False)


class OllamaGenerate(Ollama):
    name = "ollama generate"

    def accepts(self, body: dict[str, Any]) -> bool:
        return isinstance(body.get("prompt"), str)

    def upper_bound(self, body: dict[str, Any]) -> int | None:
        if "messages" in body:  # a continuation, asked as a chat
            return super().upper_bound(body)
        if body.get("images"):
            return None
        return bound([[body.get("system")], [body.get("prompt")]], self.limit(body))

    def cannot_continue(self, body: dict[str, Any], transcript: Transcript) -> str | None:
        if (why := super().cannot_continue({**body, "messages": []}, transcript)) is not None:
            return why
        if transcript.content and not body.get("raw"):
            # What the chat route cannot say the way this request was rendered.
            for name in ("suffix", "template", "context"):
                if body.get(name):
                    return f"the request's {name} cannot be carried to another server"
        return None

    def continuation(self, body: dict[str, Any], transcript: Transcript) -> dict[str, Any]:
        body = with_fewer_predicted(body, transcript.produced)
        if not transcript.text:
            return body
        if body.get("raw"):
            body["prompt"] += transcript.text  # a raw prompt simply goes on
            return body
        system = [{"role": "system", "content": body.pop("system")}] if body.get("system") else []
        user = {"role": "user", "content": body.pop("prompt")}
        if body.get("images"):
            user["images"] = body.pop("images")
        body["messages"] = [*system, user, _assistant(transcript.text)]
        return body

    def leg_path(self, path: str, continuation: dict[str, Any]) -> str:
        return "/api/chat" if "messages" in continuation else path

    def rewriter(
        self, transcript: Transcript, continuation: dict[str, Any], echo: bool | None
    ) -> OllamaRewriter:
        chat = "messages" in continuation
        prefill = continuation["messages"][-1]["content"] if chat else ""
        return OllamaRewriter(transcript, prefill, echo if chat else False, as_generate=chat)
