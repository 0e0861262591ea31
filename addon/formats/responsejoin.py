"""A Responses client's items and a continuation leg's events joined to them: the message
or reasoning item the client has open goes on in the next server's events (same item id,
indexes shifted to follow the client's, sequence numbers going on from the client's
last), and what restates the answer whole (the `.done` events, `response.completed`)
carries the whole text, the client's response id and the whole answer's usage."""

from __future__ import annotations

from typing import Any

from addon.formats.dialect import EchoStrip
from addon.formats.transcript import Transcript

STARTS = ("response.created", "response.in_progress")
ENDS = ("response.completed", "response.incomplete")


def output_text(content: Any) -> str | None:
    """The text of an output message's content parts (None when not all are text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    parts = [p.get("text") if isinstance(p, dict) else None for p in content]
    return None if any(not isinstance(p, str) for p in parts) else "".join(parts)


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


def reasoning_part(text: str) -> dict[str, Any]:
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
        item["content"] = [reasoning_part(transcript.reasoning_text)]
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


def assistant_item(text: str) -> dict[str, Any]:
    return {
        "type": "message", "role": "assistant", "content": [_text_part(text)],
    }  # fmt: skip
