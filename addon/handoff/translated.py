"""A Messages or Responses answer's continuation on llama-server, checked right before it
is sent, as a chat answer's is (handoff/seen.py).

llama-server serves both APIs through its chat route (formats/aschat.py): the model saw
the rendering of the chat request its route made of the original request, and a
continuation's trailing assistant message is read as that route renders the
continuation. So, asked of the server at the moment of use:

- its rendering (`/apply-template`) of the original request as a chat request, and of
  the continuation: the second must be the first followed by what the model wrote (with
  reasoning, whose markers the client never saw: the reasoning and the content after
  the first, as a chat answer's is held to: only while the reasoning is open);
- its own count of the continuation's prompt on the API's route (`/v1/messages/
  count_tokens`, `/v1/responses/input_tokens`) against its count of that rendering:
  where they differ, the translation is not the server's, and nothing is relied on;
- whether what the model wrote spells one of its special tokens (handoff/specials.py).

Where any fails, the answer does not go there, and the in-band error says where the
prompts part. These APIs have no text route to send the truth itself on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from addon.formats.aschat import AS_CHAT, NotTranslated
from addon.formats.continuation import prefill_of
from addon.formats.transcript import Transcript
from addon.handoff import seen, specials
from addon.handoff.builder import CannotContinue
from addon.servers.prompts import NotRendered, rendered

Render = Callable[[dict[str, Any]], Awaitable[str]]  # a chat request -> its rendering
COUNT_ROUTES = {"messages": "/v1/messages/count_tokens", "responses": "/v1/responses/input_tokens"}
CHECKED = tuple(COUNT_ROUTES)  # the dialects whose continuations are checked so


async def check(
    dialect: str,
    url: str,
    render: Render,
    ask: specials.Ask,
    original: dict[str, Any],
    continued: dict[str, Any],
    transcript: Transcript,
    router: bool,
) -> None:
    """Raises CannotContinue where the llama-server at `url` would not read `continued`
    (the `dialect`'s continuation, as it will be sent) as exactly what the model saw and
    wrote for `original`; `router`: a router, asked about the continuation's model."""
    try:
        why = await _parting(dialect, url, render, ask, original, continued, transcript, router)
    except (NotTranslated, NotRendered) as exc:
        why = f"its {dialect} prompt cannot be checked: {exc}"
    if why is not None:
        raise CannotContinue(f"{url}: {why}")


async def _parting(
    dialect: str,
    url: str,
    render: Render,
    ask: specials.Ask,
    original: dict[str, Any],
    continued: dict[str, Any],
    transcript: Transcript,
    router: bool,
) -> str | None:
    as_chat = AS_CHAT[dialect]
    saw_chat, read_chat = as_chat(original), as_chat(continued)
    prefill = prefill_of(saw_chat) or ""
    saw, read = await render(saw_chat), await render(read_chat)
    wrote = seen.written(transcript, prefill).text
    if transcript.reasoning:
        why = seen.reasoning_parting(read, saw, transcript)
    else:
        why = seen.parting(read, saw + wrote)
    model = continued.get("model") if router else None
    for text in (transcript.reasoning_text, wrote) if why is None else ():
        why = why or await specials.spelled(ask, url, text, model)
    return why or await _counted_otherwise(dialect, url, ask, continued, read)


async def _counted_otherwise(
    dialect: str, url: str, ask: specials.Ask, continued: dict[str, Any], read: str
) -> str | None:
    """Why the server's own count of `continued` on its `dialect` route is not its count
    of `read` (the rendering checked); None where they agree."""
    route = COUNT_ROUTES[dialect]
    named = {"model": continued["model"]} if "model" in continued else {}
    own = await rendered(ask, url, route, continued)
    tokens = await rendered(ask, url, "/tokenize", {**named, "content": read, "add_special": True})
    counted, checked = own.get("input_tokens"), len(tokens.get("tokens") or [])
    if counted == checked:
        return None
    return (
        f"its {route} reads the continuation as {counted} tokens, the chat request checked "
        f"as {checked}: the addon's translation of the request is not the server's"
    )
