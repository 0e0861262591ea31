"""The token pieces a chat chunk carries (each token's id and the bytes of its text), which
of them the addon asked for itself, and how they are taken out of a parsed chunk or cut
out of a block's bytes before the client sees them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

from addon.formats.chatblock import Chunk, chunks_of

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


def server_count(chunk: dict[str, Any]) -> int | None:
    """The tokens the server says its leg has generated, where the chunk says
    (llama-server's `timings.predicted_n`)."""
    timings = chunk.get("timings")
    made = timings.get("predicted_n") if isinstance(timings, dict) else None
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
            pieces = [*(pieces or []), *_id_pieces(choice, token_ids)]
            continue
        logprobs = choice.pop("logprobs", None) if strip == LOGPROBS else choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            pieces = (pieces or []) + [_piece(entry) for entry in logprobs["content"]]
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


def without_pieces(block: bytes, strip: str, chunks: list[Chunk] | None = None) -> bytes | None:
    """`block` (plain chat chunks; `chunks`, where they have been read already) with the
    token pieces cut out of its bytes as `take_pieces` strips them from a parsed chunk:
    `token_ids` and `prompt_token_ids` (vLLM's), or `logprobs` (llama-server's). The rest
    stays as the server wrote it. None where the bytes are not what they seem."""
    keys = _KEYS[strip]
    if chunks is None and (chunks := chunks_of(block)) is None:
        return None
    try:
        values = _values(chunks, keys)
        for key in keys:
            block = _cut(block, key, iter(values[key]))
    except (ValueError, StopIteration):
        return None
    if any(key[:-1] in block for key in keys):
        return None  # written another way ('"logprobs" :'): the parsed way takes it
    return block


def _values(chunks: list[Chunk], keys: tuple[bytes, ...]) -> dict[bytes, list[bytes]]:
    """The values of `keys` in the block's chunks, as written and in the order written
    (read only as far as to know where they lie)."""
    values: dict[bytes, list[bytes]] = {key: [] for key in keys}
    logprobs, token_ids = values.get(b'"logprobs":'), values.get(b'"token_ids":')
    timings, prompt_ids = values.get(b'"timings":'), values.get(b'"prompt_token_ids":')
    for chunk in chunks:
        for choice in chunk.choices:
            if logprobs is not None and choice.logprobs:
                logprobs.append(bytes(choice.logprobs))
            if token_ids is not None and choice.token_ids:
                token_ids.append(bytes(choice.token_ids))
        if timings is not None and chunk.timings:
            timings.append(bytes(chunk.timings))
        if prompt_ids is not None and chunk.prompt_token_ids:
            prompt_ids.append(bytes(chunk.prompt_token_ids))
    return values


def _cut(text: bytes, key: bytes, values: Iterator[bytes]) -> bytes:
    """`text` without each `key` and its value (the next of `values`, as written) and one
    comma beside them, in one pass: a block read at full speed holds hundreds of chunks,
    and cutting each out of the whole text again made the block's cost grow with its
    square."""
    kept: list[bytes] = []
    done = 0  # text[:done] is settled: in `kept`, or cut
    while (at := text.find(key, done)) >= 0:
        value = at + len(key)
        while text[value] in _SPACE:
            value += 1
        written = next(values)
        end = value + len(written)
        if written != text[value:end]:
            raise ValueError(f"{key!r} is not where its chunk has it")
        after = end
        while after < len(text) and text[after] in _SPACE:
            after += 1
        if text[after : after + 1] == b",":  # a member follows: its comma goes
            after += 1
            while after < len(text) and text[after] in _SPACE:
                after += 1
            kept.append(text[done:at])
            done = after
            continue
        before = at
        while before > done and text[before - 1] in _SPACE:
            before -= 1
        if before > done and text[before - 1 : before] == b",":  # the last member
            kept.append(text[done : before - 1])
        elif (
            before > done and text[before - 1 : before] == b"{" and text[after : after + 1] == b"}"
        ):
            kept.append(text[done:at])  # the only member
        else:
            raise ValueError(f"{key!r} is not a member of an object here")
        done = end
    if next(values, None) is not None:
        raise ValueError(f"{key!r} is written where its chunk does not have it")
    kept.append(text[done:])
    return b"".join(kept)


def _id_pieces(choice: dict[str, Any], token_ids: list[Any]) -> list[Piece | None]:
    delta = choice.get("delta") or {}
    fields = thought_fields(delta)
    thought = delta[fields[0]] if fields else ""
    text = thought + (delta.get("content") or choice.get("text") or "")
    pieces: list[Piece | None] = []
    for index, token in enumerate(token_ids):
        data = text.encode() if index == 0 else b""
        pieces.append((token, data) if isinstance(token, int) else None)
    return pieces


def _piece(entry: Any) -> Piece | None:
    if not isinstance(entry, dict) or not isinstance(token := entry.get("id"), int):
        return None
    try:
        return token, bytes(entry["bytes"])
    except (KeyError, TypeError, ValueError):
        return None
