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

from msgspec import UNSET

from addon.formats import sse
from addon.formats.blocks import responses_deltas
from addon.formats.continuation import bound_by
from addon.formats.dialect import (
    Event,
    Rewriter,
    Step,
    prefilled,
    unknown_echo,
    with_fewer_tokens,
)
from addon.formats.heldcalls import HeldCalls, responses_part
from addon.formats.responsejoin import (
    ENDS,
    STARTS,
    ResponsesRewriter,
    assistant_item,
    client_items,
    output_text,
    reasoning_part,
)
from addon.formats.shape import positive_int
from addon.formats.sizes import bound
from addon.formats.transcript import Transcript
from addon.formats.typedsse import TypedEventReader, encode
from addon.formats.wire import Header, error_text

SEP = sse.TERMINATOR
JSON = [(b"content-type", b"application/json")]
REASONING_DELTAS = ("response.reasoning_text.delta", "response.reasoning_summary_text.delta")
TEXT_DONE = ("response.output_text.done", "response.content_part.done")
CONTINUED_ITEMS = ("message", "reasoning")  # what a cut goes on with


class ResponsesReader(TypedEventReader):
    def __init__(self, transcript: Transcript, rewriter: Rewriter | None, server: str) -> None:
        super().__init__(transcript, rewriter, server)
        self._calls = HeldCalls()  # a new leg starts with no call's events: cut ones dropped
        self._text_done = False
        self._called = False  # a function call began in this leg

    def plain(self, block: bytes) -> bytes | None:
        """Only text deltas, which nothing but the transcript needs to read (read from
        the decode that found them so)."""
        if self.rewriter is not None or self._calls.open:
            return None
        if (deltas := responses_deltas(block)) is None:
            return None
        for event in deltas:
            self._place(event.sequence_number, event.output_index)
            self.transcript.add(event.delta)
        return block

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
        at = payload.get("output_index")
        self._place(payload.get("sequence_number", UNSET), at)
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

    def _place(self, sequence: Any, at: Any) -> None:
        """Where the client's stream is: its last event's number (UNSET: not written),
        the index after the output it has seen last."""
        wire = self.transcript.wire
        if sequence is not UNSET:
            wire["seq"] = sequence
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
            thought = [reasoning_part(transcript.reasoning_text)]
            items = [*items, {"type": "reasoning", "summary": [], "content": thought}]
        if transcript.text:
            echoed = transcript.prefill_echoed
            items = prefilled(items, transcript.text, echoed, assistant_item, output_text)
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
