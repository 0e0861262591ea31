"""Whether a server continues a partial assistant message, proven at start-up, never
assumed.

A chat continuation sends the answer so far as a trailing assistant message, asked one of
the ways in formats/continuers.py. An engine that leaves it open goes on with the same
answer; one that closes it and opens a new turn (or drops it) starts a new answer, which
the client would read as the rest of the old one. So each server is checked before it is
asked to continue anything that has sent text, each way in turn; the first that holds is
the server's.

llama-server: its template's rendering of a chat that ends in one (`/apply-template`,
which changes nothing; a router, as a fallback, renders with the model it serves) must
end with the message's own text, nothing after it. Another engine, a fallback: its
prompt, as it counts it, must grow by the message's own tokens when one is added, asked
that way (two of different lengths: the longer by exactly the difference, so it was
read, and neither by more, so no turn was closed after it; less is the part of the
generation prompt, such as an opened `<think>`, that the open message replaces). A
server that cannot be checked continues nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import httpx

from addon.formats.continuers import CHAT_WAYS, RENDERED, TRAILING_MESSAGE, Continuer
from addon.formats.shape import mapping
from addon.formats.template import ChatTemplate, NoTemplate
from addon.servers.engines import ROUTER, token_count, tokenize_request

Ask = Callable[[str, Any], Awaitable[Any]]  # (path, JSON body) -> the JSON answer
USER = {"role": "user", "content": "Continue."}
PARTIAL = "Zq7 mo"
LONGER = PARTIAL + " the river ran under the old bridge"
# An answer cut after whitespace: a template that trims the message drops it, and the
# model, going on from the text without it, writes it again.
SPACED = PARTIAL + " \n\n"
TWO_TURNS = [USER, {"role": "assistant", "content": PARTIAL}, {"role": "user", "content": "More."}]
PATH = "/v1/completions"
ERRORS = (httpx.HTTPError, ValueError, KeyError, TypeError)  # a question that went wrong


@dataclass(frozen=True)
class Proof:
    continues: bool | None  # None: not known, which counts as no
    why: str
    continuer: Continuer | None = None  # the way it is asked to, when it does
    template: ChatTemplate | None = None  # as a rendered prompt is made for it, if so
    # It drops an answer's trailing whitespace (its template trims the message): it may
    # not continue an answer whose delivered text ends in whitespace.
    trims: bool = False


async def continues(
    ask: Ask,
    engine: str,
    model: str | None,
    may_generate: bool,
    template: ChatTemplate | None = None,
) -> Proof:
    """Whether the server continues a partial assistant message, how, and why that is
    known; `template`: its model's chat template, where the addon has it (for the text
    completion way). Raises what a question raised (ERRORS)."""
    if engine == "llama-server":
        return await _rendered_open(ask, None)
    if not may_generate:
        # (A router would load the model to render the chat: that is not nothing.)
        return Proof(None, "not checked: a primary is asked nothing that generates")
    if engine == ROUTER:
        return await _rendered_open(ask, model)
    if tokenize_request(engine, "") is None:
        return Proof(None, f"not checked: {engine} has no tokenize route known to the addon")
    counted = [await _tokens(ask, engine, text) for text in ("", PARTIAL, LONGER, SPACED)]
    alone = _prompt_tokens(await ask("/v1/chat/completions", _probe([USER], model)))
    own = [n for n in counted if n is not None]
    if len(own) < len(counted) or alone is None:
        return Proof(None, "not checked: no prompt token counts in its answers")
    whys = []
    for way in [*CHAT_WAYS, RENDERED]:
        try:
            if way is RENDERED:
                found = await _reads_its_own_chat_prompt(ask, model, template, alone, own)
                if isinstance(found, Proof):
                    return replace(found, why="; ".join([*whys, found.why]))
                why = found
            else:
                why = await _grows_by_its_own(_chat_counter(ask, way, model), way, alone, own)
        except httpx.HTTPStatusError as exc:
            if way is TRAILING_MESSAGE or exc.response.status_code >= 500:
                raise
            why = f"it refuses {way.name} ({failed(exc)})"
        if why is None:
            why = f"{way.name} adds no more than its own tokens to the prompt"
            trims = await _trims(_chat_counter(ask, way, model), own)
            return Proof(True, "; ".join([*whys, why]) + (TRIMS if trims else ""), way, trims=trims)
        whys.append(why)
    return Proof(False, "; ".join(whys))


async def _rendered_open(ask: Ask, model: str | None) -> Proof:
    request: dict[str, Any] = {"model": model} if model else {}
    request["messages"] = [USER, _assistant(SPACED)]
    rendered = (await ask("/apply-template", request))["prompt"]
    if isinstance(rendered, str) and rendered.endswith(PARTIAL):
        why = "its template leaves a trailing assistant message open (/apply-template)"
        return Proof(True, why + TRIMS, TRAILING_MESSAGE, trims=True)
    if isinstance(rendered, str) and rendered.endswith(SPACED):
        why = "its template leaves a trailing assistant message open (/apply-template)"
        return Proof(True, why, TRAILING_MESSAGE)
    return Proof(False, "its template closes a trailing assistant message (/apply-template)")


Counter = Callable[[str], Awaitable[int | None]]  # a partial answer -> the prompt's tokens
TRIMS = ", but drops an answer's trailing whitespace (its template trims the message)"


async def _trims(count: Counter, own: list[int]) -> bool:
    """Whether whitespace after the message is dropped: the prompt grows by less from
    PARTIAL to SPACED than the tokenizer makes of that whitespace on its own. Not known
    counts as dropped."""
    partial, spaced = await count(PARTIAL), await count(SPACED)
    if partial is None or spaced is None:
        return True
    return spaced - partial != own[3] - own[1]


def _chat_counter(ask: Ask, way: Continuer, model: str | None) -> Counter:
    async def count(text: str) -> int | None:
        body = way.ask(_probe([USER, _assistant(text)], model))
        return _prompt_tokens(await ask("/v1/chat/completions", body))

    return count


async def _reads_its_own_chat_prompt(
    ask: Ask, model: str | None, template: ChatTemplate | None, alone: int, own: list[int]
) -> str | Proof:
    """Why a text completion of the template's rendering is not how the server continues,
    or, when it is, the proof, carrying the template as its text route is to be given it:
    its text completions read the rendering of two chats as many tokens as its chat route
    reads them (the same template), and go on from it.

    A text route that puts its tokenizer's BOS before every prompt reads a template that
    writes BOS itself as two: that BOS is left out of the rendering, when the counts then
    agree. Where the template writes none and the chat route reads none, the text route's
    own BOS is the one difference allowed (its tokenizer adds it to any text, `own[0]`),
    and said; the continuation is then what the model's tokenizer makes of the prompt."""
    name = RENDERED.name
    if template is None:
        return f"{name}: its model's chat template is not known to the addon"

    async def count(prompt: str) -> int | None:
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "cache_prompt": False}
        return _prompt_tokens(await ask(PATH, {"model": model, **body} if model else body))

    try:
        renderings = [template.render(chat) for chat in ([USER], TWO_TURNS)]
    except NoTemplate as exc:
        return f"{name}: {exc}"
    chat_two = _prompt_tokens(await ask("/v1/chat/completions", _probe(TWO_TURNS, model)))
    if chat_two is None:
        return f"{name}: no prompt token counts in its answers"
    chats = (alone, chat_two)
    bos = template.bos_token
    if bos and renderings[0].startswith(bos) and own[0] > 0:
        template = replace(template, text_route_adds_bos=True)
        renderings = [rendering.removeprefix(bos) for rendering in renderings]
    texts = []
    for rendering in renderings:
        if (text := await count(rendering)) is None:
            return f"{name}: no prompt token counts in its answers"
        texts.append(text)
    # The text route's own BOS, where the chat route reads none and the template writes none.
    added = 1 if texts[0] - alone == own[0] == 1 and not template.text_route_adds_bos else 0
    for text, chat in zip(texts, chats, strict=True):
        if text - chat != added:
            return (
                f"{name}: the template from {template.origin} renders a prompt of {text} "
                f"tokens where its chat route reads {chat}: not its template"
            )
    grows = lambda text: count(renderings[0] + text)  # noqa: E731
    if why := await _grows_by_its_own(grows, RENDERED, alone + added, own):
        return why
    why = (
        f"{name}: the template from {template.origin} renders the prompt its chat route "
        "reads, and a text completion of it goes on from the answer"
    )
    if template.text_route_adds_bos:
        why += " (its text route adds the BOS the template writes: left out of the rendering)"
    elif added:
        why += (
            " (but for the BOS its text route adds, as its tokenizer asks, where its chat "
            "route reads none)"
        )
    return Proof(True, why, RENDERED, template)


async def _grows_by_its_own(
    count: Counter, way: Continuer, alone: int, own: list[int]
) -> str | None:
    """Why the server does not continue a partial message asked `way`, or None if it does."""
    counts = []
    for text in (PARTIAL, LONGER):
        if (tokens := await count(text)) is None:
            return f"{way.name}: no prompt token counts in its answers"
        counts.append(tokens)
    partial, longer = counts
    grew, grew_longer = partial - alone, longer - alone
    own_partial, own_longer = own[1] - own[0], own[2] - own[0]  # less what any text gets
    if grew_longer - grew != own_longer - own_partial:
        return f"{way.name}: the message is not read as it was sent"
    if grew > own_partial:
        return (
            f"{way.name}: the message adds {grew} tokens to the prompt, more than its own "
            f"{own_partial}: it opens a new turn"
        )
    return None


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
