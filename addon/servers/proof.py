"""Whether a server continues a partial assistant message, proven at start-up, never
assumed.

A chat continuation sends the answer so far as a trailing assistant message. An engine
that renders it open goes on with the same answer; one that closes it and opens a new
turn starts a new answer, which the client would read as the rest of the old one. So
each server is checked before it is asked to continue anything that has sent text:
llama-server by how its template renders one (`/apply-template`, which changes nothing);
another engine, a fallback, by what its prompt grows by when one is added (its prompt
token counts against its own tokenize route): by exactly the message's own tokens when
the message stays open. A server that cannot be checked continues nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from addon.formats.shape import mapping
from addon.servers.engines import token_count, tokenize_request

Ask = Callable[[str, Any], Awaitable[Any]]  # (path, JSON body) -> the JSON answer
USER = {"role": "user", "content": "Continue."}
PARTIAL = "Zq7 mo"
ERRORS = (httpx.HTTPError, ValueError, KeyError, TypeError)  # a question that went wrong


async def continues(
    ask: Ask, engine: str, model: str | None, may_generate: bool
) -> tuple[bool | None, str]:
    """(whether the server continues a partial assistant message, why it is known);
    None: not known, which counts as no. Raises what a question raised (ERRORS)."""
    if engine == "llama-server":
        return await _rendered_open(ask)
    if not may_generate:
        return None, "not checked: a primary is asked nothing that generates"
    return await _prompt_grows_by_its_own(ask, engine, model)


async def _rendered_open(ask: Ask) -> tuple[bool, str]:
    alone = (await ask("/apply-template", {"messages": [USER]}))["prompt"]
    partial = (await ask("/apply-template", {"messages": [USER, _assistant()]}))["prompt"]
    if isinstance(alone, str) and partial == alone + PARTIAL:
        return True, "its template leaves a trailing assistant message open (/apply-template)"
    return False, "its template closes a trailing assistant message (/apply-template)"


async def _prompt_grows_by_its_own(
    ask: Ask, engine: str, model: str | None
) -> tuple[bool | None, str]:
    counting, empty = tokenize_request(engine, PARTIAL), tokenize_request(engine, "")
    if counting is None or empty is None:
        return None, f"not checked: {engine} has no tokenize route known to the addon"
    alone = _prompt_tokens(await ask("/v1/chat/completions", _probe([USER], model)))
    partial = await ask("/v1/chat/completions", _probe([USER, _assistant()], model))
    partial = _prompt_tokens(partial)
    own = token_count(await ask(*counting))
    around = token_count(await ask(*empty))  # what the route adds to any text (a BOS)
    if alone is None or partial is None or own is None or around is None:
        return None, "not checked: no prompt token counts in its answers"
    grew, own = partial - alone, own - around
    if grew == own:
        return True, f"a trailing assistant message adds only its own {own} tokens to the prompt"
    return False, (
        f"a trailing assistant message adds {grew} tokens to the prompt, not its own "
        f"{own}: it opens a new turn"
    )


def _assistant() -> dict[str, str]:
    return {"role": "assistant", "content": PARTIAL}


def _probe(messages: list[dict[str, str]], model: str | None) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": 1, "temperature": 0, "cache_prompt": False}
    return {"model": model, **body} if model else body


def _prompt_tokens(answer: Any) -> int | None:
    count = mapping(mapping(answer).get("usage")).get("prompt_tokens")
    return count if isinstance(count, int) else None


def failed(exc: BaseException) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code} from {exc.request.url.path}"
    return repr(exc)
