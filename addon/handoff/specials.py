"""Text a model wrote that spells a special token of the next server (`<|im_end|>` or
`<think>` written as ordinary pieces): llama-server reads a prompt's text with its
special tokens parsed, on the chat route and the text route alike, so that text would
become the special token itself there. Asked of the server at the moment of use: its
ids of the text with and without special tokens parsed."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

Ask = Callable[[str, Any], Awaitable[Any]]  # a question to one server: path, body -> JSON


async def spelled(ask: Ask, url: str, text: str) -> str | None:
    """Why `text` cannot go to the server at `url` as text (None: it can)."""
    if not text:
        return None
    try:
        parsed = await _pieces(ask, text, True)
        plain = await _pieces(ask, text, False)
    except Exception as exc:  # whatever failed, it is not known: not sent
        return f"{url} could not say whether what the model wrote spells its special tokens: {exc}"
    if [token for token, _ in parsed] == [token for token, _ in plain]:
        return None
    at = next(i for i, (a, b) in enumerate(zip(parsed, plain, strict=False)) if a != b)
    return (
        f"what the model wrote spells {parsed[at][1]!r}, which {url} reads as its special "
        "token, not as the text the model wrote"
    )


async def _pieces(ask: Ask, text: str, special: bool) -> list[tuple[int, str]]:
    body = {"content": text, "parse_special": special, "with_pieces": True, "add_special": False}
    tokens = (await ask("/tokenize", body))["tokens"]
    return [(entry["id"], str(entry.get("piece"))) for entry in tokens]
