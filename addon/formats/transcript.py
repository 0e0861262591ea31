"""What the client has received: the answer's text and reasoning, the token ids behind
them, each leg's usage, and what each wire format keeps about the stream the client reads.
Every later leg is asked to go on from here."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from msgspec import UNSET

from addon.formats.blocks import NO_DELTA, Chunk
from addon.formats.pieces import (
    REASONING_FIELDS,
    Piece,
    read_count,
    read_pieces,
    server_count,
    take_pieces,
    thought_fields,
)


@dataclass
class LegUsage:
    server: str
    model: str | None = None
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    raw_pieces: bool = False  # its pieces are its tokens' own bytes (see begin_leg)


@dataclass
class Transcript:
    role_sent: bool = False
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)  # reasoning deltas
    # The fields the client reads reasoning in (of REASONING_FIELDS: llama-server's,
    # vLLM's, or both at once).
    reasoning_fields: tuple[str, ...] = ()
    produced: int = 0  # tokens delivered: one per delta, or as their ids count them
    # Whether the server that wrote the answer's first text sent the client's assistant
    # prefill back at the start of it (known from the request and the engine, never
    # from the text: handoff/seen.py); None where that is not known.
    prefill_echoed: bool | None = False
    id: str | None = None
    created: int | None = None
    legs: list[LegUsage] = field(default_factory=list)
    other_parts: set[str] = field(default_factory=set)  # what cannot be replayed: tool calls
    # Each leg's prompt reading as its server timed it: (server, tokens read, ms).
    reads: list[tuple[str, int, float]] = field(default_factory=list)
    # The token ids behind the delivered text, while every leg has reported them in one
    # vocabulary, `vocabulary` (a tokenizer's fingerprint; ids of two never mix).
    ids: list[int] | None = field(default_factory=list)
    vocabulary: str | None = None
    id_bytes: bytearray = field(default_factory=bytearray)
    ids_ahead: bool = False  # the last ids came without their text (vLLM holds it back)
    # What the model wrote, byte for byte: every piece's bytes while each chunk with text
    # brought its pieces (those bytes are the tokens' own, before the server's parser
    # trimmed or moved any of it). Known to be whole only where the server counted the
    # tokens it generated (`counted`): a token it sent no piece for leaves a gap, which
    # is a character's earlier byte tokens (their bytes ride with its last one) or
    # something the client never saw (a marker its parser kept): then `raw_lost`.
    raw: bytearray = field(default_factory=bytearray)
    raw_whole: bool = True
    counted: bool = False
    unseen: int = 0  # tokens of gaps no character explains: what the model wrote is lost
    # The request's stop strings: the server holds text that may start one and sends it
    # later with the next token's piece (a gap whose bytes all arrive).
    stops: tuple[str, ...] = ()
    # What a wire format keeps about the stream the client reads (open blocks, item ids).
    wire: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning)

    def standing(self) -> Transcript:
        """The answer as it stands now, apart from this transcript, which its leg goes on
        writing while a continuation built from it is checked (awaiting its servers)."""
        return replace(
            self,
            content=list(self.content),
            reasoning=list(self.reasoning),
            legs=[replace(leg) for leg in self.legs],
            other_parts=set(self.other_parts),
            reads=list(self.reads),
            ids=None if self.ids is None else list(self.ids),
            id_bytes=bytearray(self.id_bytes),
            raw=bytearray(self.raw),
            wire=dict(self.wire),
        )

    def timed(self, chunk: dict[str, Any]) -> None:
        """A leg's last chunk: how long its server took to read the prompt, if it says."""
        timings = chunk.get("timings")
        if isinstance(timings, dict) and self.legs:
            read, ms = timings.get("prompt_n"), timings.get("prompt_ms")
            if isinstance(read, int) and isinstance(ms, int | float):
                self.reads.append((self.legs[-1].server, read, float(ms)))

    def begin_leg(
        self,
        server: str,
        vocabulary: str | None = None,
        raw_pieces: bool = False,
        echoes: bool | None = False,
    ) -> None:
        """A leg from `server`, whose tokenizer is `vocabulary` (None: not known), and
        whose pieces, where it sends them, are its tokens' own bytes (`raw_pieces`:
        llama-server's logprobs; vLLM's ids carry the parsed text); `echoes`: it sends
        the client's prefill back first, where it is the first to write (the request
        as the client sent it)."""
        if not (self.content or self.reasoning):
            self.prefill_echoed = echoes
        if self.legs and not raw_pieces:
            self.raw_whole = False
        self.legs.append(LegUsage(server, raw_pieces=raw_pieces))
        if not self.ids:
            self.vocabulary = vocabulary
        elif vocabulary is None or vocabulary != self.vocabulary:
            self.ids = None  # the answer so far can only be replayed as text now

    @property
    def raw_lost(self) -> bool:
        return self.unseen > 0

    def raw_output(self) -> str | None:
        """The text the model wrote, exactly, when every token of it is accounted for by
        the server's own count (None: not known byte for byte; the delivered text is
        then the best knowledge of it)."""
        if not (self.counted and self.raw_whole) or self.raw_lost:
            return None
        try:
            return bytes(self.raw).decode()
        except UnicodeDecodeError:
            return None

    def exact_ids(self) -> list[int] | None:
        """The ids of the delivered answer, when they are known and spell exactly the
        delivered text (a token whose text a server held back fails this: fail closed)."""
        said = (self.reasoning_text + self.text).encode()  # vLLM's reasoning comes first
        if self.ids is None or self.ids_ahead or bytes(self.id_bytes) != said:
            return None
        return self.ids

    def add(self, text: str | None, thought: str | None = None) -> None:
        """Account for one delta of answer text or reasoning the client has received
        (servers here send one per token)."""
        leg = self.legs[-1]
        if text and self.reasoning and not self.content:
            # The tag that closed the reasoning: its bytes came in no piece, so what the
            # model wrote is not known byte for byte past here. It was a token too, with
            # no delta of its own (vLLM sends its id alone: counted with it).
            self.raw_whole = False
            if not self.ids_ahead:
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

    def record(
        self, chunk: dict[str, Any], pieces: list[Piece] | None = None, made: int | None = None
    ) -> None:
        """Account for a chat chunk that has been written to the client; `pieces` are the
        ids behind it (taken from its logprobs when not given), `made` the server's count
        of the tokens its leg has generated (read from the chunk when not given)."""
        self._heading(chunk.get("id"), chunk.get("created"), chunk.get("model", UNSET))
        counted = self.produced
        choices = chunk.get("choices") or ()
        for choice in choices:
            delta = choice.get("delta") or {}
            if delta.get("role"):
                self.role_sent = True
            self.add(delta.get("content") or choice.get("text"), self._thought(delta))
            if delta.get("tool_calls"):
                self.other_parts.add("tool_calls")
        if pieces is None:
            pieces = take_pieces(chunk)
        spoke = pieces is None and any(_said(choice) for choice in choices)
        self._record_ids(pieces, spoke, self.produced - counted)
        self._recount(pieces, server_count(chunk) if made is None else made)

    def record_read(self, chunk: Chunk) -> None:
        """`record` for an ordinary token chunk as blocks.py read it (no tool call, no
        finish: formats/blocks.py), with no second decode of its bytes."""
        self._heading(chunk.id, chunk.created, chunk.model)
        counted = self.produced
        spoke = False
        for choice in chunk.choices:
            delta = choice.delta or NO_DELTA
            if delta.role:
                self.role_sent = True
            if thought := delta.thought:
                self.reasoning_fields = self.reasoning_fields or tuple(
                    name for name in REASONING_FIELDS if getattr(delta, name)
                )
            self.add(delta.content or choice.text, thought)
            spoke = spoke or bool(delta.content or thought)
        pieces = read_pieces(chunk)
        self._record_ids(pieces, spoke and pieces is None, self.produced - counted)
        self._recount(pieces, read_count(chunk))

    def _heading(self, answer_id: Any, created: Any, model: Any) -> None:
        """What every chunk repeats: the answer's id and time, the leg's model (UNSET:
        not written)."""
        if self.id is None:
            self.id, self.created = answer_id, created
        if model is not UNSET:
            self.legs[-1].model = model

    def _thought(self, delta: dict[str, Any]) -> str | None:
        """The delta's reasoning, in whichever fields its server writes it (once)."""
        if delta.keys().isdisjoint(REASONING_FIELDS):
            return None  # most deltas: answer text alone
        fields = thought_fields(delta)
        self.reasoning_fields = self.reasoning_fields or fields
        return delta[fields[0]] if fields else None

    def _record_ids(self, pieces: list[Piece] | None, spoke: bool, counted: int) -> None:
        """Take the chunk's ids, `pieces`; `spoke`: it has text but no ids; `counted`
        tokens were counted from its deltas."""
        if pieces is None:
            if spoke:
                self.raw_whole = False
                self.ids = None  # text without ids: it can only be replayed as text
            return
        said = b"".join(data for _, data in pieces)
        self.raw += said
        # One chunk may carry more tokens than its deltas: vLLM's when its API server falls
        # behind or holds a token's text back, llama-server's when it held text back (half
        # of a character, the start of a stop string). Its ids count them, and the marker
        # that closed the reasoning, which vLLM sends as ids with an empty delta. vLLM's
        # ids are every token it generated: where `add` counted that marker at the first
        # content after its id came (merged with the last reasoning token's), they say
        # one fewer, and are right (llama-server's count is its `timings`, `_recount`).
        more = len(pieces) - counted
        if more > 0 or (more < 0 and not self.legs[-1].raw_pieces):
            self.produced += more
            self.legs[-1].completion_tokens += more
        if self.ids is None:
            return
        self.ids.extend(token for token, _ in pieces)
        self.id_bytes += said
        if pieces:
            self.ids_ahead = not said

    def _recount(self, pieces: list[Piece] | None, made: int | None) -> None:
        """Correct the leg's count to the server's own, `made` (None: it gave none).

        llama-server sends no chunk for a token whose text it holds (the first byte tokens
        of a character, a marker its parser keeps from the client), and the next chunk's
        piece has the held bytes with only the last token's id: the ids are then
        incomplete, and where the gap is more than the chunk's characters could hide, what
        the model wrote is not known byte for byte."""
        if made is None:
            return
        leg = self.legs[-1]
        self.counted = True
        gap = made - leg.completion_tokens
        self.produced += gap
        leg.completion_tokens = made
        if gap <= 0:
            return
        self.ids = None
        if gap > self._hideable(b"".join(data for _, data in pieces or ())):
            self.unseen += gap

    def _hideable(self, data: bytes) -> int:
        """How many held tokens a chunk's piece bytes `data` can account for: the earlier
        byte tokens of its first character (held until the character is whole, they
        arrive with its last token's piece), or, where the request has stop strings,
        text held while it could start one (it then holds a stop's first character).
        Any other gap is text the client never saw (a marker the parser kept)."""
        text = data.decode(errors="ignore")
        if any(stop[0] in text for stop in self.stops if stop):
            return len(data) - 1  # each held token had a byte at least
        return len(text[:1].encode()) - 1


def stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    """The request's stop strings (`stop`: one, or a list)."""
    stop = body.get("stop")
    found = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    return tuple(text for text in found if isinstance(text, str) and text)


def _said(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or any(delta.get(name) for name in REASONING_FIELDS))
