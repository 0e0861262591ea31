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
out whole, like a chat tool call (formats/heldcalls.py). Reasoning carries over as
in chat: cut while reasoning, the next server goes on in the client's reasoning item;
cut after the text began, its restatement of the reasoning is dropped.

The answer ends at `response.completed`, not at its text's `.done`: OpenAI, vLLM and
hosted APIs close the message item before they add a function call's item and stream
its arguments. An item's finishing events are held until something follows them, so a
leg cut after them (during a call, or before the response's end) goes on in the
message the client still has open, and the stall watch stays on until the end.
"""

from __future__ import annotations

import json
from typing import Any

from addon.formats import sse
from addon.formats.continuation import bound_by
from addon.formats.dialect import (
    EchoStrip,
    Event,
    Rewriter,
    Step,
    prefilled,
    unknown_echo,
    with_fewer_tokens,
)
from addon.formats.heldcalls import HeldCalls, responses_part
from addon.formats.shape import positive_int
from addon.formats.sizes import bound
from addon.formats.transcript import Transcript
from addon.formats.typedsse import TypedEventReader, encode
from addon.formats.wire import Header, error_text

SEP = sse.TERMINATOR
JSON = [(b"content-type", b"application/json")]
STARTS = ("response.created", "response.in_progress")
REASONING_DELTAS = ("response.reasoning_text.delta", "response.reasoning_summary_text.delta")
TEXT_DONE = ("response.output_text.done", "response.content_part.done")
CONTINUED_ITEMS = ("message", "reasoning")  # what a cut goes on with
ENDS = ("response.completed", "response.incomplete")


def output_text(content: Any) -> str | None:
    """The text of an output message's content parts (None when not all are text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    parts = [p.get("text") if isinstance(p, dict) else None for p in content]
    return None if any(not isinstance(p, str) for p in parts) else "".join(parts)


class ResponsesReader(TypedEventReader):
    def __init__(self, transcript: Transcript, rewriter: Rewriter | None, server: str) -> None:
        super().__init__(transcript, rewriter, server)
        self._calls = HeldCalls()  # a new leg starts with no call's events: cut ones dropped
        self._text_done = False
        self._called = False  # a function call began in this leg

    def plain(self, block: bytes) -> bytes | None:
        """Only text deltas, which nothing but the transcript needs to read."""
        plain = (
            self.rewriter is None
            and not self._calls.open
            and block.count(b'"type":"response.output_text.delta"') == block.count(SEP)
            and b'"error"' not in block
        )
        return block if plain else None

    def failure(self, payload: dict[str, Any]) -> str | None:
        kind = payload.get("type")
        if kind == "error" or ("error" in payload and kind is None):
            return error_text(payload.get("error") or payload)
        if kind == "response.failed":
            return error_text((payload.get("response") or {}).get("error") or "response failed")
        return None

    def sort(self, payload: dict[str, Any], data: bytes) -> list[Event]:
        kind = payload.get("type")
        if kind in ENDS:
            return [Event(Step.END, data)]
        if (call := self._calls.take(responses_part(payload), data)) is not None:
            self._called = True
            if not call:
                return []
            return [Event(Step.SEND, b"".join(call), {**payload, "type": "function_call"})]
        item = payload.get("item") or {}
        if kind in TEXT_DONE or (
            kind == "response.output_item.done" and item.get("type") in CONTINUED_ITEMS
        ):
            self._text_done |= kind == TEXT_DONE[0]
            return [Event(Step.HOLD, data, payload)]  # a cut goes on in the open item
        return [Event(Step.SEND, data, payload)]

    def record(self, payload: dict[str, Any]) -> None:
        transcript, wire, kind = self.transcript, self.transcript.wire, payload.get("type")
        if "sequence_number" in payload:
            wire["seq"] = payload["sequence_number"]
        at = payload.get("output_index")
        if kind == "response.output_text.delta":
            transcript.add(payload.get("delta"))
        elif kind in REASONING_DELTAS:
            transcript.add(None, payload.get("delta"))
        elif kind == "response.output_item.added":
            item = payload.get("item") or {}
            wire.setdefault("items", {})[item.get("type")] = (item.get("id"), at)
            wire["open"] = item.get("type")
        elif kind == "response.output_item.done":
            wire.pop("open", None)
        elif kind == "function_call":
            transcript.other_parts.add("a function call")
        elif kind in STARTS and "response" not in wire:
            response = payload.get("response") or {}
            wire["response"] = response.get("id")
            transcript.legs[-1].model = response.get("model")
        if isinstance(at, int):
            wire["next"] = max(wire.get("next", 0), at + 1)

    def close(self) -> bytes | None:
        """The stream ended, cleanly, after the whole text of an answer with no call, and
        before `response.completed`; None where a call began (it may be cut, or missing
        from a restated response) or the text is not done."""
        if not self._text_done or self._called or self.transcript.other_parts:
            return None
        wire = self.transcript.wire
        response = {
            "id": wire.get("response"), "object": "response", "status": "completed",
            "output": client_items(self.transcript, wire.get("items", {})),
        }  # fmt: skip
        return encode({"type": "response.completed", "response": response})


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def client_items(transcript: Transcript, items: dict[str, Any], but: set | None = None) -> list:
    """The client's message and reasoning items, whole, in output order (but those whose
    ids are in `but`)."""
    ordered = sorted(items.items(), key=lambda entry: entry[1][1] or 0)
    return [
        _whole(transcript, items, {"type": kind, "id": item_id, "status": "completed"})
        for kind, (item_id, _) in ordered
        if kind in ("message", "reasoning") and item_id not in (but or ())
    ]


def _whole(transcript: Transcript, items: dict[str, Any], item: dict[str, Any]) -> dict:
    """A client's item restated whole: its message's text, its reasoning."""
    if item.get("type") == "message" and item.get("id") == items.get("message", (0,))[0]:
        parts = [p for p in item.get("content") or () if isinstance(p, dict)]
        base = parts[0] if parts else _text_part("")
        item.update(role="assistant", content=[{**base, "text": transcript.text}])
    elif item.get("type") == "reasoning" and "reasoning" in items:
        item.update(id=items["reasoning"][0], summary=item.get("summary", []))
        item["content"] = [_reasoning_part(transcript.reasoning_text)]
    return item


class ResponsesRewriter:
    """A continuation leg's events as the rest of the client's response: its message or
    reasoning item merged into the one the client has open, a reasoning item it restates
    after the answer went on to text dropped, new items numbered after the client's."""

    def __init__(self, transcript: Transcript, prefill: str, echo: bool | None) -> None:
        self._transcript = transcript
        self._wire = {**transcript.wire, "items": dict(transcript.wire.get("items", {}))}
        self._echo = {
            "response.output_text.delta": EchoStrip(prefill, echo),
            "response.reasoning_text.delta": EchoStrip(transcript.reasoning_text, echo),
        }
        self._seq = self._wire.get("seq")  # None: the client's stream has no numbers
        self._ids: dict[Any, Any] = {}  # this leg's item ids -> the client's
        self._dropped: set[Any] = set()  # this leg's restatement of finished reasoning
        self._shift: int | None = None  # from this leg's output indexes to the client's

    def rewrite(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        kind = payload.get("type")
        if kind in STARTS and self._wire.get("response"):
            return []  # the client has its response
        item = payload.get("item") if isinstance(payload.get("item"), dict) else {}
        out: list[dict[str, Any]] = []
        if kind == "response.output_item.added":
            closing = self._added(payload, item)
            if closing is None:
                return []  # merged into the client's open item, or dropped
            out = closing
        leg_id = payload.get("item_id", item.get("id"))
        if leg_id in self._dropped:
            return []
        if (client_id := self._ids.get(leg_id)) is not None:
            if kind == "response.content_part.added":
                return []  # the client's open item has its part
            if "item_id" in payload:
                payload["item_id"] = client_id
            if item:
                item["id"] = client_id
            if kind == "response.output_item.done":
                self._wire.pop("open", None)  # this leg closed the client's open item
            strip = self._echo.get(kind)
            if strip is not None and not (payload := self._stripped(payload, strip)):
                return []
        if isinstance(payload.get("output_index"), int) and self._shift is not None:
            payload["output_index"] += self._shift
        self._whole(kind, payload, item)
        for event in (*out, payload):
            if self._seq is not None:
                self._seq += 1
                event["sequence_number"] = self._seq
        return [*out, payload]

    @staticmethod
    def _stripped(payload: dict[str, Any], strip: EchoStrip) -> dict[str, Any]:
        payload["delta"] = strip(payload.get("delta") or "")
        return payload if payload["delta"] else {}

    def _added(self, payload: dict[str, Any], item: dict[str, Any]) -> list[dict] | None:
        """A new item from this leg: None when it merges into the client's open item (or
        restates finished reasoning); else the events that close the client's open item."""
        kind, leg_id, at = item.get("type"), item.get("id"), payload.get("output_index")
        if kind == "reasoning" and self._transcript.content:
            self._dropped.add(leg_id)
            return None
        wire, items = self._wire, self._wire["items"]
        if wire.get("open") == kind and kind in items:
            self._ids[leg_id] = items[kind][0]
            if isinstance(at, int) and isinstance(items[kind][1], int):
                self._shift = items[kind][1] - at
            return None
        if wire.get("open") in items and items[wire["open"]][0] in self._ids.values():
            return []  # the open item is this leg's too, which closes it itself (a call's
            # item added while the message is open, as llama-server does)
        closing = []
        if (open_kind := wire.pop("open", None)) in items:
            closing.append(self._done(open_kind))
        if isinstance(at, int) and self._shift is None:
            self._shift = wire.get("next", 0) - at
        wire["open"] = kind
        return closing

    def _done(self, kind: str) -> dict[str, Any]:
        """`output_item.done` for the client's open item, whole."""
        client_id, at = self._wire["items"][kind]
        item = self._filled({"type": kind, "id": client_id, "status": "completed"})
        event: dict[str, Any] = {"type": "response.output_item.done", "item": item}
        return event if not isinstance(at, int) else {**event, "output_index": at}

    def _filled(self, item: dict[str, Any]) -> dict[str, Any]:
        return _whole(self._transcript, self._wire["items"], item)

    def _whole(self, kind: Any, payload: dict[str, Any], item: dict[str, Any]) -> None:
        """The `.done` events and the response restate the whole answer, not this leg's."""
        mine = payload.get("item_id") in self._ids.values()
        if kind == "response.output_text.done" and mine:
            payload["text"] = self._transcript.text
        elif kind == "response.reasoning_text.done" and mine:
            payload["text"] = self._transcript.reasoning_text
        elif kind == "response.content_part.done" and mine:
            payload["part"] = {**(payload.get("part") or {}), "text": self._transcript.text}
        elif kind == "response.output_item.done" and item:
            self._filled(item)
        elif kind in ENDS:
            self._whole_response(payload.get("response") or {})

    def _whole_response(self, response: dict[str, Any]) -> None:
        response["id"] = self._wire.get("response", response.get("id"))
        output = []
        for item in response.get("output") or ():
            if isinstance(item, dict):
                item["id"] = self._ids.get(item.get("id"), item.get("id"))
                output.append(self._filled(item))
        # Items only the client's earlier legs wrote come first.
        ids = {item.get("id") for item in output}
        earlier = client_items(self._transcript, self._wire["items"], but=ids)
        response["output"] = [*earlier, *output]
        if isinstance(usage := response.get("usage"), dict):
            response["usage"] = self._whole_answer_usage(usage)

    def _whole_answer_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        output = self._transcript.whole_answer_tokens(usage.get("output_tokens"))
        prompt = int(usage.get("input_tokens") or 0)
        return {**usage, "output_tokens": output, "total_tokens": prompt + output}


def _assistant(text: str) -> dict[str, Any]:
    return {
        "type": "message", "role": "assistant", "content": [_text_part(text)],
    }  # fmt: skip


class Responses:
    name = "responses"
    sizes_rooms = False
    shadowed = False

    def accepts(self, body: dict[str, Any]) -> bool:
        items = body.get("input")
        return isinstance(items, str) or (
            isinstance(items, list) and all(isinstance(i, dict) for i in items)
        )

    def streaming(self, body: dict[str, Any]) -> bool:
        return body.get("stream") is True

    def limit(self, body: dict[str, Any]) -> int | None:
        return positive_int(body.get("max_output_tokens"))

    def upper_bound(self, body: dict[str, Any]) -> int | None:
        if body.get("tools"):
            return None
        items = body["input"]
        turns = [[items]] if isinstance(items, str) else [_turn(item) for item in items]
        return bound([[body.get("instructions")], *turns], self.limit(body))

    def reader(
        self,
        transcript: Transcript,
        rewriter: Rewriter | None,
        strip_pieces: str | None,
        server: str,
    ) -> ResponsesReader:
        return ResponsesReader(transcript, rewriter, server)

    def note(self, text: str) -> bytes:
        return sse.comment(text) + SEP

    def error_end(self, message: str) -> bytes:
        return encode({"type": "error", "code": "server_error", "message": message, "param": None})

    def refusal(self, message: str) -> tuple[list[Header], bytes]:
        body = {"error": {"code": 502, "message": message, "type": "server_error"}}
        return JSON, json.dumps(body).encode()

    def continues_a_turn(self, body: dict[str, Any]) -> bool:
        return True

    def cannot_continue(self, body: dict[str, Any], transcript: Transcript) -> str | None:
        if transcript.other_parts:
            return "the answer so far has a function call, which cannot be continued elsewhere"
        if transcript.content and (why := bound_by(body)) is not None:
            return why
        if (prefill := _prefill(body)) is not None and output_text(prefill) is None:
            return "the client's assistant prefill is not plain text"
        return unknown_echo(transcript)

    def continuation(self, body: dict[str, Any], transcript: Transcript) -> dict[str, Any]:
        body = with_fewer_tokens(body, transcript.produced, ("max_output_tokens",))
        if not transcript.text and not transcript.reasoning:
            return body
        items = body["input"]
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]  # as the server reads a string
        if transcript.reasoning:
            thought = [_reasoning_part(transcript.reasoning_text)]
            items = [*items, {"type": "reasoning", "summary": [], "content": thought}]
        if transcript.text:
            echoed = transcript.prefill_echoed
            items = prefilled(items, transcript.text, echoed, _assistant, output_text)
        body["input"] = items
        return body

    def leg_path(self, path: str, continuation: dict[str, Any]) -> str:
        return path

    def rewriter(
        self, transcript: Transcript, continuation: dict[str, Any], echo: bool | None
    ) -> ResponsesRewriter:
        prefill = _prefill(continuation)
        return ResponsesRewriter(transcript, output_text(prefill) or "", echo)


def _turn(item: dict[str, Any]) -> list[Any] | None:
    """What an input item holds for the size bound: a message's content, a reasoning
    item's summary and content; None for a call, its output, or anything else."""
    kind = item.get("type", "message")
    if kind == "message":
        return [item.get("content")]
    if kind == "reasoning":
        return [item.get("summary"), item.get("content")]
    return None


def _prefill(body: dict[str, Any]) -> Any:
    """The content of an assistant message that ends the input, if one does."""
    items = body.get("input")
    last = items[-1] if isinstance(items, list) and items else None
    if isinstance(last, dict) and last.get("role") == "assistant":
        return last.get("content")
    return None
