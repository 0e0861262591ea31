"""What of a chat request reaches its model's chat template: the messages and everything
an engine renders with them (llama-server's `oaicompat_chat_params_parse`, vLLM's chat
utils). The engine's rendering of exactly this is what the model saw."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

RENDERED_FIELDS = (
    "messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
    "reasoning_format", "reasoning_effort", "add_generation_prompt",
    "continue_final_message", "documents",
)  # fmt: skip


def parting_at(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Where two renderings (text or ids) first differ (the shorter's length where one
    begins the other)."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def rendering_request(body: dict[str, Any]) -> dict[str, Any]:
    """The fields of `body` that its template is rendered with (a copy)."""
    return {name: copy.deepcopy(body[name]) for name in RENDERED_FIELDS if name in body}
