"""llama-server's chat route asked to read exactly the truth (what the model saw, then
what it wrote), with its parser left to read what follows: reasoning, content, tool
calls.

llama-server continues a final assistant message by appending it to the generation
prompt (`continue_final_message`: "content" puts the message's reasoning, closed, before
its content; "reasoning_content" leaves the reasoning open), where its template's
markers and whitespace may differ from what the model saw or wrote. So the addon asks
it first where a marked message lands (`/apply-template`): the text before the mark must
be the start of the truth, and the rest of the truth is what the message then carries.
That request's own rendering is compared with the truth again before it is used.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from addon.handoff import seen

Render = Callable[[dict[str, Any]], Awaitable[str]]  # a chat request -> its rendering
MARK = "\x1fspillover-mark\x1f"  # a text no template writes or trims
CONTENT, REASONING = "content", "reasoning_content"


async def placed(
    render: Render, chat: dict[str, Any], truth: str, reasoning_open: bool
) -> tuple[dict[str, Any] | None, str]:
    """The chat request, from `chat` (the continuation as a trailing message), whose
    rendering on the server is exactly `truth`, going on inside the reasoning where
    `reasoning_open`; else None and where the two part, for a person."""
    field = REASONING if reasoning_open else CONTENT
    rendered = await render(_carrying(chat, field, MARK))
    at = rendered.find(MARK)
    if at < 0 or rendered[at + len(MARK) :]:
        ending = rendered[-2 * seen.CONTEXT :]
        return None, f"a trailing message's {field} is not where its prompt ends: {ending!r}"
    head = rendered[:at]
    if not truth.startswith(head):
        return None, seen.parting(head, truth[: len(head)]) or ""
    asked = _carrying(chat, field, truth[len(head) :])
    if (why := seen.parting(await render(asked), truth)) is not None:
        return None, why
    return asked, ""


def _carrying(chat: dict[str, Any], field: str, text: str) -> dict[str, Any]:
    """`chat` whose trailing assistant message holds `text` alone, in `field`, continued
    there."""
    last = {"role": "assistant", "content": "", field: text}
    messages = [*chat["messages"][:-1], last]
    return {**chat, "messages": messages, "continue_final_message": field,
            "add_generation_prompt": False}  # fmt: skip
