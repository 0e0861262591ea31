"""The question the tests and the recorder ask the tiny models, and the request they send."""

from __future__ import annotations

from typing import Any

PROMPT = [{"role": "user", "content": "Tell me a story about the river and the bridge."}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def chat_body(max_tokens: int = 200, **extra: Any) -> dict[str, Any]:
    # cache_prompt=false: a prompt half-served from a slot's cache is computed in other
    # batch shapes, which can flip a near-tie token of these random-weight models.
    return {
        "messages": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "cache_prompt": False,
        **extra,
    }
