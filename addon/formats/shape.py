"""The fields of a client's request that the addon reads, taken whatever shape they came in.

llama-server accepts many shapes for one field (a string or content parts, an object or
a string), and a client can send anything. The addon never assumes: a field it cannot
read is treated as absent, or as a reason to leave the answer where it is.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

_DECODE = msgspec.json.Decoder().decode
_ENCODE = msgspec.json.Encoder().encode
DEPTH_LIMIT = 100  # levels of nesting in a body the addon reads; deeper passes through


def loads(raw: bytes | str) -> Any:
    """`json.loads`, where a document nested too deep to parse is malformed like any
    other (a ValueError, not a RecursionError). msgspec reads first (a quarter of
    json's time on a chunk, and the same value: integers of any size, floats rounded
    alike); what it refuses (a lone surrogate escaped by a server, NaN, a number past
    a float) is json's to read or refuse, so the answer is always json.loads's."""
    try:
        return _DECODE(raw)
    except (msgspec.MsgspecError, RecursionError):
        pass
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("JSON nested too deep to read") from None


def dumps(value: Any) -> bytes:
    """A request body as `json.dumps` writes it, in value. msgspec writes first (an
    eighth of json's time on a prompt of 32,000 token ids); json writes what it
    refuses (a lone surrogate, as `loads` may have read) and what it writes otherwise:
    msgspec writes a float that is not a number as null, json as NaN. So where a null is
    written (a field the client sent as null, or the word in a prompt's text), what was
    written is read back and must be the value itself (about half json's time at 32,000
    ids)."""
    try:
        written = _ENCODE(value)
    except (msgspec.MsgspecError, UnicodeEncodeError, RecursionError):
        return json.dumps(value).encode()
    if written.find(b"null") >= 0 and not _reads_back(written, value):
        return json.dumps(value).encode()
    return written


def _reads_back(written: bytes, value: Any) -> bool:
    try:
        return bool(_DECODE(written) == value)
    except (msgspec.MsgspecError, RecursionError):
        return False


def nested_deeper_than(value: Any, limit: int = DEPTH_LIMIT) -> bool:
    """Whether lists and objects in `value` nest more than `limit` levels deep (walked
    without recursion: copying or writing such a value again could exhaust the stack)."""
    level: list[Any] = [value]
    for _ in range(limit + 1):
        level = [
            child
            for item in level
            if isinstance(item, dict | list)
            for child in (item.values() if isinstance(item, dict) else item)
        ]
        if not level:
            return False
    return True


def positive_int(value: Any) -> int | None:
    """A count the client gave (a token limit, a number of candidates), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def mapping(value: Any) -> dict[str, Any]:
    """An object field (`stream_options`, `chat_template_kwargs`); anything else is empty."""
    return value if isinstance(value, dict) else {}


def text_of(content: Any) -> str | None:
    """A message's content as plain text: a string, nothing, or text parts only; None
    when it holds something else (an image, a malformed part)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            return None
        if not isinstance(text := part.get("text"), str):
            return None
        texts.append(text)
    return "".join(texts)


CONSTRAINT_FIELDS = (
    "grammar", "json_schema", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "regex", "ebnf", "format",
)  # fmt: skip


def constraint_of(body: dict[str, Any]) -> str | None:
    """The field that binds the answer's shape (JSON, a grammar, a pattern, choices), if
    any, in any API or engine's terms: OpenAI's `response_format`, Anthropic's
    `output_format` and Responses' `text.format` (anything but plain text, whatever its
    shape), llama.cpp's `grammar` and `json_schema`, vLLM's `structured_outputs` and its
    older `guided_*` fields, SGLang's `regex` and `ebnf`, Ollama's `format`."""
    for name in ("response_format", "output_format"):
        if (value := body.get(name)) and mapping(value).get("type") != "text":
            return name
    text_format = mapping(body.get("text")).get("format")
    if text_format and mapping(text_format).get("type") != "text":
        return "text.format"
    return next((name for name in CONSTRAINT_FIELDS if body.get(name)), None)
