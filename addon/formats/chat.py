"""OpenAI chat and text completion streams (/v1/chat/completions, /v1/completions).

Ordinary token chunks of a first leg go out unread. Anything else is parsed: a
continuation leg's chunks are rewritten into the client's stream, ids the client did not
ask for are taken out, tool-call pieces are held until a call is whole, and the finishing
chunks are held until [DONE].
"""

from __future__ import annotations

import json
from typing import Any

from addon.formats import sse
from addon.formats.blocks import ordinary_chunks
from addon.formats.continuation import (
    ChunkRewriter,
    cannot_continue,
    continuation_body,
    prefill_of,
    token_limit,
)
from addon.formats.dialect import (
    Event,
    Garbled,
    Rewriter,
    Step,
    has_messages,
    json_object,
)
from addon.formats.pieces import (
    LOGPROBS_COUNTED,
    TIMINGS,
    server_count,
    take_pieces,
    without_pieces,
)
from addon.formats.sizes import bound
from addon.formats.startover import NotAContinuation
from addon.formats.toolcalls import ToolCallHold, calls_chunk
from addon.formats.transcript import Transcript
from addon.formats.wire import Header, error_event, error_text

SEP = sse.TERMINATOR
JSON = [(b"content-type", b"application/json")]


def ends_answer(chunk: dict[str, Any]) -> bool:
    choices = chunk.get("choices")
    if not choices:
        return bool(chunk.get("usage"))
    return any(choice.get("finish_reason") is not None for choice in choices)


class ChatReader:
    def __init__(
        self,
        transcript: Transcript,
        rewriter: Rewriter | None,
        strip_pieces: str | None,
        server: str,
    ) -> None:
        self.transcript = transcript
        self.rewriter = rewriter
        self.strip_pieces = strip_pieces
        self.server = server
        self._fast = rewriter is None
        self._calls = ToolCallHold()  # a new leg starts with no call pieces: cut ones dropped
        self._finished = False

    boundary = SEP
    splitter = sse.EventSplitter
    events = staticmethod(sse.events)

    def plain(self, block: bytes) -> bytes | None:
        if not self._fast or (chunks := ordinary_chunks(block)) is None:
            return None
        # Ids the client did not ask for are cut out of the bytes; the transcript reads
        # them from the chunks as the server sent them, at once: the decode is done.
        unread = without_pieces(block, self.strip_pieces, chunks) if self.strip_pieces else block
        if unread is not None:
            for chunk in chunks:
                self.transcript.record_read(chunk)
        return unread

    def take(self, event: bytes) -> list[Event] | str:
        if sse.is_comment(event):
            return [Event(Step.SEND, event + SEP)]
        if sse.is_done(event):
            return [Event(Step.END, sse.DONE + SEP)]
        chunk = json_object(event, sse.parse)
        if isinstance(chunk, str):
            return Garbled(f"garbled event from {self.server}: {chunk}")
        if "error" in chunk:
            return f"in-band error from {self.server}: {error_text(chunk['error'])}"
        if self.rewriter is None:
            return self._sorted(chunk, event, False)
        try:
            rewritten = self.rewriter.rewrite(chunk)
        except NotAContinuation as why:
            return str(why)
        # A rewriter gives the chunk as the client reads it, None for nothing, or the
        # chunks it held (formats/startover.py), each sorted as if it came alone.
        chunks = rewritten if isinstance(rewritten, list) else [rewritten]
        return [e for one in chunks if one is not None for e in self._sorted(one, event, True)]

    def _sorted(self, chunk: dict[str, Any], event: bytes, changed: bool) -> list[Event]:
        """The events of one chunk (`event` as its server sent it; `changed`: rewritten)."""
        pieces, made = None, None
        if self.strip_pieces and (changed or b'"logprobs"' in event or b'"token_ids"' in event):
            pieces = take_pieces(chunk, self.strip_pieces)
            changed = True
        counted = self.strip_pieces in (LOGPROBS_COUNTED, TIMINGS)
        if counted and "timings" in chunk and not ends_answer(chunk):
            # The count the addon asked for; the last chunk's timings are the server's own.
            made = server_count(chunk)
            del chunk["timings"]
            changed = True
        if changed:
            event = sse.encode(chunk)
        taken: list[Event] = []
        if b'"tool_calls"' in event:
            envelope = {k: v for k, v in chunk.items() if k != "choices"}
            chunk, ready = self._calls.split(chunk)
            if ready:
                whole = calls_chunk(envelope, ready)
                taken.append(Event(Step.SEND, sse.encode(whole) + SEP, (whole, None)))
            if chunk is None:
                return taken
            event = sse.encode(chunk)
        if self._finished or ends_answer(chunk):
            self._finished = True
            self.transcript.timed(chunk)
            if ready := self._calls.flush():
                taken.append(Event(Step.FINISH, sse.encode(calls_chunk(chunk, ready)) + SEP))
            return [*taken, Event(Step.FINISH, event + SEP)]
        return [*taken, Event(Step.SEND, event + SEP, (chunk, pieces, made))]

    def record(self, payload: tuple[dict[str, Any], Any]) -> None:
        self.transcript.record(*payload)

    def close(self) -> bytes | None:
        # The server finished its answer and died before [DONE]: the answer is whole.
        return sse.DONE + SEP if self._finished else None


class Chat:
    name = "chat"
    sizes_rooms = True
    shadowed = True

    def __init__(self, field: str) -> None:
        self.field = field  # what the answer continues from: "messages" or "prompt"

    def accepts(self, body: dict[str, Any]) -> bool:
        if self.field == "messages":
            if not has_messages(body):
                return False  # malformed: the primary answers with its own error
        elif not isinstance(body.get("prompt"), str):
            return False  # token-id prompts: passed through as they are
        return body.get("n", 1) == 1  # several choices per answer are passed through

    def streaming(self, body: dict[str, Any]) -> bool:
        return body.get("stream") is True

    def limit(self, body: dict[str, Any]) -> int | None:
        return token_limit(body)

    def upper_bound(self, body: dict[str, Any]) -> int | None:
        if isinstance(prompt := body.get("prompt"), list):  # a replay's token ids and text
            ids = sum(1 for p in prompt if isinstance(p, int))
            texts = bound([[p for p in prompt if not isinstance(p, int)]], self.limit(body))
            return None if texts is None else ids + texts
        if "messages" not in body:  # a completion's prompt, or a chat rendered into one
            return bound([[prompt]], self.limit(body))
        if body.get("tools"):
            return None
        turns = [
            None if not isinstance(m, dict) or m.get("tool_calls") else
            [m.get("content"), m.get("reasoning_content")]
            for m in body["messages"]
        ]  # fmt: skip
        return bound(turns, self.limit(body))

    def reader(
        self,
        transcript: Transcript,
        rewriter: Rewriter | None,
        strip_pieces: str | None,
        server: str,
    ) -> ChatReader:
        return ChatReader(transcript, rewriter, strip_pieces, server)

    def note(self, text: str) -> bytes:
        return sse.comment(text) + SEP

    def error_end(self, message: str) -> bytes:
        return error_event(message) + SEP

    def refusal(self, message: str) -> tuple[list[Header], bytes]:
        body = {"error": {"code": 502, "message": message, "type": "server_error"}}
        return JSON, json.dumps(body).encode()

    def continues_a_turn(self, body: dict[str, Any]) -> bool:
        return not isinstance(body.get("prompt"), str)  # a text completion just goes on

    def cannot_continue(self, body: dict[str, Any], transcript: Transcript) -> str | None:
        return cannot_continue(body, transcript)

    def continuation(self, body: dict[str, Any], transcript: Transcript) -> dict[str, Any]:
        return continuation_body(body, transcript)

    def leg_path(self, path: str, continuation: dict[str, Any]) -> str:
        return path

    def rewriter(
        self, transcript: Transcript, continuation: dict[str, Any], echo: bool | None
    ) -> ChunkRewriter:
        return ChunkRewriter(transcript, prefill_of(continuation) or "", echo)
