"""Whether a server continues a partial assistant message, proven at start-up, never
assumed.

A chat continuation sends the answer so far as a trailing assistant message. An engine
that leaves it open goes on with the same answer; one that closes it and opens a new turn
(or drops it) starts a new answer, which the client would read as the rest of the old
one. So each server is checked before it is asked to continue anything that has sent
text. llama-server: its template's rendering of a chat that ends in one (`/apply-template`,
which changes nothing; a router, as a fallback, renders with the model it serves) must
end with the message's own text, nothing after it. Another
engine, a fallback: its prompt, as it counts it, must grow by the message's own tokens
when one is added (two of different lengths: the longer by exactly the difference, so
it was read, and neither by more, so no turn was closed after it; less is the part of
the generation prompt, such as an opened `<think>`, that the open message replaces). A
server that cannot be checked continues nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from addon.formats.shape import mapping
from addon.servers.engines import ROUTER, token_count, tokenize_request

Ask = Callable[[str, Any], Awaitable[Any]]  # (path, JSON body) -> the JSON answer
USER = {"role": "user", "content": "Continue."}
PARTIAL = "Zq7 mo"
LONGER = PARTIAL + " the river ran under the old bridge"
ERRORS = (httpx.HTTPError, ValueError, KeyError, TypeError)  # a question that went wrong


async def continues(
    ask: Ask, engine: str, model: str | None, may_generate: bool
) -> tuple[bool | None, str]:
    """(whether the server continues a partial assistant message, why it is known);
    None: not known, which counts as no. Raises what a question raised (ERRORS)."""
    if engine == "llama-server":
        return await _rendered_open(ask, None)
    if not may_generate:
        # (A router would load the model to render the chat: that is not nothing.)
        return None, "not checked: a primary is asked nothing that generates"
    if engine == ROUTER:
        return await _rendered_open(ask, model)
    return await _prompt_grows_by_its_own(ask, engine, model)


async def _rendered_open(ask: Ask, model: str | None) -> tuple[bool, str]:
    request: dict[str, Any] = {"model": model} if model else {}
    request["messages"] = [USER, _assistant(PARTIAL)]
    rendered = (await ask("/apply-template", request))["prompt"]
    if isinstance(rendered, str) and rendered.endswith(PARTIAL):
        return True, "its template leaves a trailing assistant message open (/apply-template)"
    return False, "its template closes a trailing assistant message (/apply-template)"


async def _prompt_grows_by_its_own(
    ask: Ask, engine: str, model: str | None
) -> tuple[bool | None, str]:
    if tokenize_request(engine, "") is None:
        return None, f"not checked: {engine} has no tokenize route known to the addon"
    counts = []
    for messages in ([USER], [USER, _assistant(PARTIAL)], [USER, _assistant(LONGER)]):
        counts.append(_prompt_tokens(await ask("/v1/chat/completions", _probe(messages, model))))
    own = [await _tokens(ask, engine, text) for text in ("", PARTIAL, LONGER)]
    if None in counts or None in own:
        return None, "not checked: no prompt token counts in its answers"
    alone, partial, longer = counts
    grew, grew_longer = partial - alone, longer - alone
    own_partial, own_longer = own[1] - own[0], own[2] - own[0]  # less what any text gets
    if grew_longer - grew != own_longer - own_partial:
        return False, "a trailing assistant message is not read as it was sent"
    if grew > own_partial:
        return False, (
            f"a trailing assistant message adds {grew} tokens to the prompt, more than its "
            f"own {own_partial}: it opens a new turn"
        )
    return True, "a trailing assistant message adds no more than its own tokens to the prompt"


async def _tokens(ask: Ask, engine: str, text: str) -> int | None:
    request = tokenize_request(engine, text)
    assert request is not None
    return token_count(await ask(*request))


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


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
