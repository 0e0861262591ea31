"""The token pieces a chat chunk carries (each token's id and the bytes of its text), which
of them the addon asked for itself, and how they are taken out of a parsed chunk or cut
out of a block's bytes before the client sees them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, cast

import msgspec

from addon.formats.blocks import NO_DELTA, Chunk, chunks_of

Piece = tuple[int, bytes]  # a token id and the bytes of its text
# Which pieces the addon asked for itself, in the first server's engine's terms, and so
# takes out again before the client sees them (see handoff/exact.py).
TOKEN_IDS = "token_ids"  # vLLM's `return_token_ids`
LOGPROBS = "logprobs"  # llama-server's logprobs, with each token's id
# llama-server's logprobs and, in every chunk but the last, `timings` (`timings_per_token`,
# whose `predicted_n` is the server's own count of the tokens it generated).
LOGPROBS_COUNTED = "logprobs+timings"
# The client asked for logprobs: only the `timings` the addon asked with them are its own.
TIMINGS = "timings"
# Where a chat chunk's delta carries reasoning: llama-server's `reasoning_content`, and
# vLLM's `reasoning` (vLLM 0.32's only one; the builds between its rename and the old
# name's removal, about 0.12 to 0.15, write both in each delta, the same text).
REASONING_FIELDS = ("reasoning_content", "reasoning")
_LOADS = msgspec.json.Decoder().decode


class _Entry(msgspec.Struct, gc=False):  # (gc=False: see blocks.py)
    id: int
    bytes: list[Annotated[int, msgspec.Meta(ge=0, le=255)]]


class _Logprobs(msgspec.Struct, gc=False):
    content: list[_Entry] | None = None


class _Timings(msgspec.Struct, gc=False):
    predicted_n: Any = None


_LOGPROBS = msgspec.json.Decoder(_Logprobs).decode
_TIMINGS = msgspec.json.Decoder(_Timings).decode


def server_count(chunk: dict[str, Any]) -> int | None:
    """The tokens the server says its leg has generated, where the chunk says
    (llama-server's `timings.predicted_n`)."""
    timings = chunk.get("timings")
    return _count(timings.get("predicted_n") if isinstance(timings, dict) else None)


def read_count(chunk: Chunk) -> int | None:
    """`server_count` for a chunk as blocks.py read it."""
    if not chunk.timings:
        return None
    try:
        return _count(_TIMINGS(chunk.timings).predicted_n)
    except msgspec.ValidationError:
        return None  # not an object: no count


def _count(made: Any) -> int | None:
    return made if isinstance(made, int) and not isinstance(made, bool) else None


def thought_fields(delta: dict[str, Any]) -> tuple[str, ...]:
    """The REASONING_FIELDS a delta carries reasoning in (a build that writes both
    writes the same text in each)."""
    return tuple(name for name in REASONING_FIELDS if delta.get(name))


def take_pieces(chunk: dict[str, Any], strip: str | None = None) -> list[Piece] | None:
    """The token pieces a chat chunk carries (None when it carries none): llama-server's
    in its logprobs, each token with its bytes; vLLM's as `token_ids`, the chunk's text
    given to its first. `strip` (TOKEN_IDS or LOGPROBS) names the ones the addon asked
    for, which are removed from the chunk: the client's own stay."""
    pieces: list[Piece | None] | None = None
    if strip == LOGPROBS_COUNTED:
        strip = LOGPROBS
    if strip == TOKEN_IDS:
        chunk.pop("prompt_token_ids", None)
    for choice in chunk.get("choices") or ():
        taken = choice.pop if strip == TOKEN_IDS else choice.get
        token_ids = taken("token_ids", None)
        if isinstance(token_ids, list):
            found = _id_pieces(token_ids, _text_of(choice))
        else:
            logprobs = choice.pop("logprobs", None) if strip == LOGPROBS else choice.get("logprobs")
            if (found := _logprob_pieces(logprobs)) is None:
                continue
        pieces = [*(pieces or []), *found]
    return _known(pieces)


def read_pieces(chunk: Chunk) -> list[Piece] | None:
    """`take_pieces` for a chunk as blocks.py read it (its pieces' fields decoded only
    now); nothing is stripped: the cut takes them out of the bytes."""
    pieces: list[Piece | None] | None = None
    for choice in chunk.choices:
        token_ids = _LOADS(choice.token_ids) if choice.token_ids else None
        if isinstance(token_ids, list):
            delta = choice.delta or NO_DELTA
            text = (delta.thought or "") + (delta.content or choice.text or "")
            found = _id_pieces(token_ids, text)
        elif (found := _read_logprob_pieces(choice.logprobs)) is None:
            continue
        pieces = found if pieces is None else [*pieces, *found]
    return _known(pieces)


def _known(pieces: list[Piece | None] | None) -> list[Piece] | None:
    if pieces is None or None in pieces:
        return None  # none, or in a form without ids: the text is what can be replayed
    return cast(list[Piece], pieces)  # no None among them


_SPACE = b" \t\r\n"
_KEYS = {
    TOKEN_IDS: (b'"token_ids":', b'"prompt_token_ids":'),
    LOGPROBS: (b'"logprobs":',),
    LOGPROBS_COUNTED: (b'"logprobs":', b'"timings":'),
    TIMINGS: (b'"timings":',),
}
# Where each key's values lie in a chunk as blocks.py read it.
_WHERE: dict[bytes, Callable[[Chunk], list[msgspec.Raw]]] = {
    b'"token_ids":': lambda chunk: [choice.token_ids for choice in chunk.choices],
    b'"prompt_token_ids":': lambda chunk: [chunk.prompt_token_ids],
    b'"logprobs":': lambda chunk: [choice.logprobs for choice in chunk.choices],
    b'"timings":': lambda chunk: [chunk.timings],
}
# Each key as a bare name (as in '"logprobs" :'), to see that none is left once cut.
_NAMES = {strip: tuple(key[:-1] for key in keys) for strip, keys in _KEYS.items()}


def without_pieces(block: bytes, strip: str, chunks: list[Chunk] | None = None) -> bytes | None:
    """`block` (plain chat chunks; `chunks`, where they have been read already) with the
    token pieces cut out of its bytes as `take_pieces` strips them from a parsed chunk:
    `token_ids` and `prompt_token_ids` (vLLM's), or `logprobs` (llama-server's). The rest
    stays as the server wrote it. None where the bytes are not what they seem."""
    if chunks is None and (chunks := chunks_of(block)) is None:
        return None
    try:
        for key in _KEYS[strip]:
            block = _cut(block, key, _values(chunks, key))
    except ValueError:
        return None
    for name in _NAMES[strip]:
        if block.find(name) >= 0:  # (find: see sse.EventSplitter.feed)
            return None  # written another way ('"logprobs" :'): the parsed way takes it
    return block


def _values(chunks: list[Chunk], key: bytes) -> list[msgspec.Raw]:
    """The values of `key` in the block's chunks, as written and in the order written
    (read only as far as to know where they lie)."""
    where = _WHERE[key]
    return [value for chunk in chunks for value in where(chunk) if value]


def _cut(text: bytes, key: bytes, values: list[msgspec.Raw]) -> bytes:
    """`text` without each `key` and its value (the next of `values`, as written) and one
    comma beside them, in one pass: a block read at full speed holds hundreds of chunks,
    and cutting each out of the whole text again made the block's cost grow with its
    square. (Each step looks at the compact spelling first: servers write no spaces.)"""
    kept: list[bytes] = []
    done = 0  # text[:done] is settled: in `kept`, or cut
    for written in values:
        if (at := text.find(key, done)) < 0:
            raise ValueError(f"{key!r} is not where its chunk has it")
        value = at + len(key)
        if at > done and text[at - 1] == 44 and text.startswith(written, value):
            kept.append(text[done : at - 1])  # ',"key":value', as servers write it
            done = value + len(written)
            continue
        if text[value] in _SPACE:
            value = _skip_space(text, value)
        if not text.startswith(written, value):
            raise ValueError(f"{key!r} is not where its chunk has it")
        end = value + len(written)
        after = _skip_space(text, end) if end < len(text) and text[end] in _SPACE else end
        before = at if text[at - 1] not in _SPACE else _skip_space_back(text, at, done)
        if text.startswith(b",", after):  # a member follows: its comma goes
            kept.append(text[done:at])
            done = _skip_space(text, after + 1)
        elif before > done and text[before - 1] == 44:  # after a comma: the last member
            kept.append(text[done : before - 1])
            done = end
        elif before > done and text[before - 1] == 123 and text.startswith(b"}", after):
            kept.append(text[done:at])  # after "{", before "}": the only member
            done = end
        else:
            raise ValueError(f"{key!r} is not a member of an object here")
    kept.append(text[done:])  # (a key left there is found by without_pieces)
    return b"".join(kept)


def _skip_space(text: bytes, at: int) -> int:
    while at < len(text) and text[at] in _SPACE:
        at += 1
    return at


def _skip_space_back(text: bytes, at: int, done: int) -> int:
    while at > done and text[at - 1] in _SPACE:
        at -= 1
    return at


def _text_of(choice: dict[str, Any]) -> str:
    """A parsed choice's reasoning and text, in that order."""
    delta = choice.get("delta") or {}
    fields = thought_fields(delta)
    thought = delta[fields[0]] if fields else ""
    return thought + (delta.get("content") or choice.get("text") or "")


def _id_pieces(token_ids: list[Any], text: str) -> list[Piece | None]:
    """vLLM's ids: the chunk's text given to its first."""
    pieces: list[Piece | None] = []
    for index, token in enumerate(token_ids):
        data = text.encode() if index == 0 else b""
        pieces.append((token, data) if isinstance(token, int) else None)
    return pieces


def _logprob_pieces(logprobs: Any) -> list[Piece | None] | None:
    """llama-server's: each logprobs entry's id and bytes (None: no entries)."""
    if isinstance(logprobs, dict) and isinstance(content := logprobs.get("content"), list):
        return [
            _piece(entry.get("id"), entry.get("bytes")) if isinstance(entry, dict) else None
            for entry in content
        ]
    return None


def _read_logprob_pieces(logprobs: msgspec.Raw) -> list[Piece | None] | None:
    """`_logprob_pieces` from their bytes, reading only each entry's id and bytes (its
    token, probability and alternatives skipped unparsed)."""
    if not logprobs:
        return None
    try:
        content = _LOGPROBS(logprobs).content
    except msgspec.ValidationError:  # not the usual shape: read whole
        return _logprob_pieces(_LOADS(logprobs))
    if content is None:
        return None
    return [(entry.id, bytes(entry.bytes)) for entry in content]


def _piece(token: Any, data: Any) -> Piece | None:
    if not isinstance(token, int) or not isinstance(data, list):
        return None
    try:
        return token, bytes(data)
    except (TypeError, ValueError):  # not byte values
        return None
