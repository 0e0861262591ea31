"""How many tokens a request takes at most, known from its size alone.

No token holds less than one byte of text, and a chat template adds a few tokens around
each message, so a request's text in bytes, plus an allowance per message, plus the
tokens it may still write, bounds what it takes on any server. Where a request holds
what is not plain text (images, tools and tool calls, which each template renders in its
own way), only the server can count it: there is no bound. Each API says which of its
fields are the turns (`Dialect.upper_bound`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

TEMPLATE_TOKENS_PER_MESSAGE = 32  # role markers and separators, generously
# Text parts of a content list, by type: the field that holds the text.
TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "reasoning_text": "text",
    "summary_text": "text",
    "thinking": "thinking",
}


def text_bytes(content: Any) -> int | None:
    """Bytes of text in a message's content: a string, or a list of text parts; None for
    anything else."""
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content.encode())
    if not isinstance(content, list):
        return None
    total = 0
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        field = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if field is None or not isinstance(text := part.get(field), str):
            return None
        total += len(text.encode())
    return total


def bound(turns: Iterable[Sequence[Any]] | None, limit: int | None) -> int | None:
    """At most this many tokens for these turns (each its contents: text, reasoning)
    and a limit on what is written; None where a turn, or a content, is not text."""
    if turns is None:
        return None
    total = 0
    for contents in turns:
        if contents is None:
            return None
        for content in contents:
            if (size := text_bytes(content)) is None:
                return None
            total += size
        total += TEMPLATE_TOKENS_PER_MESSAGE
    return total + (limit or 0)
