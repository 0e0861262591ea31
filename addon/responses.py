"""OpenAI Responses streams (/v1/responses).

The stream is one response of output items: `response.created`, then a message item
(`output_item.added`, `content_part.added`, `output_text.delta`s, and the `.done` events
that restate its whole text), then `response.completed` with the whole response. A
continuation asks the next server for the same response with the answer so far as an
assistant output message at the end of `input`, and its events join the client's
stream: no second `response.created`, its message item merged into the one the client
has open (same item id, indexes shifted to follow the client's, sequence numbers going
on from the client's last), the `.done` events and `response.completed` carrying the
whole text, the client's response id and the whole answer's usage. A function call goes
out whole, like a chat tool call.
"""

from __future__ import annotations

import json
from typing import Any

from addon import sse
from addon.continuation import Transcript
from addon.dialect import EchoStrip, Event, Rewriter, Step, prefilled, with_fewer_tokens
from addon.wire import Header, error_text

SEP = sse.TERMINATOR
JSON = [(b"content-type", b"application/json")]
STARTS = ("response.created", "response.in_progress")
ENDS = ("response.completed", "response.incomplete")


def encode(payload: dict[str, Any]) -> bytes:
    return b"event: " + str(payload.get("type")).encode() + b"\n" + sse.encode(payload) + SEP


def output_text(content: Any) -> str | None:
    """The text of an output message's content parts (None when not all are text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    parts = [p.get("text") if isinstance(p, dict) else None for p in content]
    return None if any(not isinstance(p, str) for p in parts) else "".join(parts)


def _failure(payload: dict[str, Any]) -> str | None:
    kind = payload.get("type")
    if kind == "error" or ("error" in payload and kind is None):
        return error_text(payload.get("error") or payload)
    if kind == "response.failed":
        return error_text((payload.get("response") or {}).get("error") or "response failed")
    return None


class ResponsesReader:
    boundary = SEP
    splitter = sse.EventSplitter
    events = staticmethod(sse.events)

    def __init__(self, transcript: Transcript, rewriter: Rewriter | None, server: str) -> None:
        self.transcript = transcript
        self.rewriter = rewriter
        self.server = server
        self._call: list[bytes] | None = None  # a function call's events, until it is whole
        self._finished = False

    def plain(self, block: bytes) -> bool:
        """Only text deltas, which nothing but the transcript needs to read."""
        return (
            self.rewriter is None
            and self._call is None
            and block.count(b'"type":"response.output_text.delta"') == block.count(SEP)
            and b'"error"' not in block
        )

    def take(self, event: bytes) -> list[Event] | str:
        if sse.is_comment(event):
            return [Event(Step.SEND, event + SEP)]
        try:
            payload = sse.parse(event)
            if not isinstance(payload, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            return f"garbled event from {self.server}: {exc}"
        if (failure := _failure(payload)) is not None:
            return f"in-band error from {self.server}: {failure}"
        if self.rewriter is None:
            return self._sort(payload, event + SEP)
        taken: list[Event] = []
        for rewritten in self.rewriter.rewrite(payload):
            taken += self._sort(rewritten, encode(rewritten))
        return taken

    def _sort(self, payload: dict[str, Any], data: bytes) -> list[Event]:
        kind = payload.get("type")
        if kind in ENDS:
            return [Event(Step.END, data)]
        if self._finished or kind == "response.output_text.done":
            self._finished = True
            return [Event(Step.FINISH, data)]
        item = payload.get("item") or {}
        if kind == "response.output_item.added" and item.get("type") == "function_call":
            self._call = [data]
            return []
        if self._call is not None:
            self._call.append(data)
            if kind != "response.output_item.done":
                return []
            whole, self._call = b"".join(self._call), None
            return [Event(Step.SEND, whole, {"type": "function_call", **_seq(payload)})]
        return [Event(Step.SEND, data, payload)]

    def record(self, payload: dict[str, Any]) -> None:
        transcript, wire, kind = self.transcript, self.transcript.wire, payload.get("type")
        if "sequence_number" in payload:
            wire["seq"] = payload["sequence_number"]
        if kind == "response.output_text.delta":
            transcript.add(payload.get("delta"))
        elif kind in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta"):
            transcript.add(None, payload.get("delta"))
        elif kind == "response.output_item.added" and "item" not in wire:
            item = payload.get("item") or {}
            if item.get("type") == "message":
                wire["item"] = item.get("id")
                wire["output_index"] = payload.get("output_index")
        elif kind == "function_call":
            transcript.other_parts.add("a function call")
        elif kind in STARTS and "response" not in wire:
            response = payload.get("response") or {}
            wire["response"] = response.get("id")
            transcript.legs[-1].model = response.get("model")

    def read_block(self, block: bytes) -> None:
        for event in sse.events(block):
            try:
                payload = sse.parse(event)
            except ValueError:
                continue  # delivered as the server sent it; nothing to account for
            if isinstance(payload, dict):
                self.record(payload)

    def close(self) -> bytes | None:
        """The server wrote the whole text and died before `response.completed`."""
        if not self._finished:
            return None
        wire = self.transcript.wire
        message = {
            "type": "message", "id": wire.get("item"), "status": "completed",
            "role": "assistant", "content": [_text_part(self.transcript.text)],
        }  # fmt: skip
        response = {
            "id": wire.get("response"), "object": "response", "status": "completed",
            "output": [message],
        }  # fmt: skip
        return encode({"type": "response.completed", "response": response})


def _seq(payload: dict[str, Any]) -> dict[str, Any]:
    return {"sequence_number": payload["sequence_number"]} if "sequence_number" in payload else {}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


class ResponsesRewriter:
    """A continuation leg's events as the rest of the client's response."""

    def __init__(self, transcript: Transcript, prefill: str, echo: bool | None) -> None:
        self._transcript = transcript
        self._wire = dict(transcript.wire)
        self._echo = EchoStrip(prefill, echo)
        self._seq = self._wire.get("seq")  # None: the client's stream has no numbers
        self._leg_item: Any = None  # this leg's message item, merged into the client's
        self._shift = 0  # from this leg's output indexes to the client's

    def rewrite(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        kind, wire = payload.get("type"), self._wire
        if kind in STARTS and wire.get("response"):
            return []  # the client has its response
        item = payload.get("item") or {}
        added = kind == "response.output_item.added"
        if added and item.get("type") == "message" and wire.get("item") and not self._leg_item:
            self._leg_item = item.get("id")
            if isinstance(at := payload.get("output_index"), int):
                self._shift = (wire.get("output_index") or 0) - at
            return []  # the client's message item goes on
        ours = self._leg_item is not None and payload.get("item_id") == self._leg_item
        if kind == "response.content_part.added" and ours:
            return []
        if ours:
            payload["item_id"] = wire["item"]
        if isinstance(payload.get("output_index"), int):
            payload["output_index"] += self._shift
        if kind == "response.output_text.delta" and ours:
            payload["delta"] = self._echo(payload.get("delta") or "")
            if not payload["delta"]:
                return []
        self._whole(kind, payload, item)
        if self._seq is not None:
            self._seq += 1
            payload["sequence_number"] = self._seq
        return [payload]

    def _whole(self, kind: Any, payload: dict[str, Any], item: dict[str, Any]) -> None:
        """The `.done` events and the response restate the whole answer, not this leg's."""
        text = self._transcript.text
        if kind == "response.output_text.done" and payload.get("item_id") == self._wire["item"]:
            payload["text"] = text
        elif kind == "response.content_part.done" and payload.get("item_id") == self._wire["item"]:
            payload["part"] = {**(payload.get("part") or {}), "text": text}
        elif kind == "response.output_item.done" and item.get("id") == self._leg_item:
            self._merge(item, text)
        elif kind in ENDS:
            response = payload.get("response") or {}
            response["id"] = self._wire.get("response", response.get("id"))
            for output in response.get("output") or ():
                if isinstance(output, dict) and output.get("id") == self._leg_item:
                    self._merge(output, text)
            if isinstance(usage := response.get("usage"), dict):
                response["usage"] = self._whole_answer_usage(usage)

    def _merge(self, item: dict[str, Any], text: str) -> None:
        item["id"] = self._wire["item"]
        parts = [p for p in item.get("content") or () if isinstance(p, dict)]
        item["content"] = [{**(parts[0] if parts else _text_part("")), "text": text}]

    def _whole_answer_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        legs = self._transcript.legs
        legs[-1].completion_tokens = int(usage.get("output_tokens") or 0)
        output = sum(leg.completion_tokens for leg in legs)
        prompt = int(usage.get("input_tokens") or 0)
        return {**usage, "output_tokens": output, "total_tokens": prompt + output}


def _assistant(text: str) -> dict[str, Any]:
    return {
        "type": "message", "role": "assistant", "content": [_text_part(text)],
    }  # fmt: skip


class Responses:
    name = "responses"
    sizes_rooms = False

    def accepts(self, body: dict[str, Any]) -> bool:
        items = body.get("input")
        return isinstance(items, str) or (
            isinstance(items, list) and all(isinstance(i, dict) for i in items)
        )

    def streaming(self, body: dict[str, Any]) -> bool:
        return body.get("stream") is True

    def reader(
        self, transcript: Transcript, rewriter: Rewriter | None, strip_pieces: bool, server: str
    ) -> ResponsesReader:
        return ResponsesReader(transcript, rewriter, server)

    def note(self, text: str) -> bytes:
        return sse.comment(text) + SEP

    def error_end(self, message: str) -> bytes:
        return encode({"type": "error", "code": "server_error", "message": message, "param": None})

    def refusal(self, message: str) -> tuple[list[Header], bytes]:
        body = {"error": {"code": 502, "message": message, "type": "server_error"}}
        return JSON, json.dumps(body).encode()

    def cannot_continue(self, body: dict[str, Any], transcript: Transcript) -> str | None:
        if transcript.other_parts:
            return "the answer so far has a function call, which cannot be continued elsewhere"
        if transcript.reasoning:
            return "the answer so far has reasoning, which is not carried in a Responses stream"
        if (prefill := _prefill(body)) is not None and output_text(prefill) is None:
            return "the client's assistant prefill is not plain text"
        return None

    def continuation(self, body: dict[str, Any], transcript: Transcript) -> dict[str, Any]:
        body = with_fewer_tokens(body, transcript.produced, ("max_output_tokens",))
        if transcript.text:
            items = body["input"]
            if isinstance(items, str):
                items = [{"role": "user", "content": items}]  # as the server reads a string
            body["input"] = prefilled(items, transcript.text, _assistant, output_text)
        return body

    def rewriter(
        self, transcript: Transcript, continuation: dict[str, Any], echo: bool | None
    ) -> ResponsesRewriter:
        prefill = _prefill(continuation)
        return ResponsesRewriter(transcript, output_text(prefill) or "", echo)


def _prefill(body: dict[str, Any]) -> Any:
    """The content of an assistant message that ends the input, if one does."""
    items = body.get("input")
    last = items[-1] if isinstance(items, list) and items else None
    if isinstance(last, dict) and last.get("role") == "assistant":
        return last.get("content")
    return None
