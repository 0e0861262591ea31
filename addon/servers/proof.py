"""Whether a server continues a partial assistant message, proven at start-up, never
assumed.

A chat continuation sends the answer so far as a trailing assistant message, asked one of
the ways in formats/continuers.py. An engine that leaves it open goes on with the same
answer; one that closes it and opens a new turn (or drops it) starts a new answer, which
the client would read as the rest of the old one. So each server is checked before it is
asked to continue anything that has sent text, each way in turn; the first that holds is
the server's.

llama-server: its template's rendering of a chat that ends in one (`/apply-template`,
which changes nothing; a router, as a fallback, renders with the model it serves) must be
its rendering of the chat without it, generation prompt included, followed by the
message's text (then also asked with a system message, earlier turns, a tool call and
content parts, for its status). Where it is not, the server still continues chat
answers, as a text completion of its own rendering (handoff/nextleg.py, which checks
again for each answer). Another engine, a fallback: its
prompt, as it counts it, must grow by the message's own tokens when one is added, asked
that way (two of different lengths: the longer by exactly the difference, so it was
read, and neither by more, so no turn was closed after it; less is the part of the
generation prompt, such as an opened `<think>`, that the open message replaces). A
server that cannot be checked continues nothing. A server none of whose engine routes
are known (a hosted API, a gateway) is checked by how it behaves through its chat route
alone (servers/behaviour.py), when it is a fallback.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import httpx

from addon.formats.continuers import (
    CHAT_WAYS,
    OWN_RENDERING,
    RENDERED,
    TRAILING_MESSAGE,
    Continuer,
)
from addon.formats.rendering import parting_at
from addon.formats.shape import mapping
from addon.formats.template import ChatTemplate, NoTemplate
from addon.servers.behaviour import behaviour
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
    # Known from how it behaved through its chat route alone (servers/behaviour.py): a
    # continuation there is checked by its first words only (formats/startover.py).
    by_behaviour: bool = False
    echoes: bool | None = None  # it echoes a prefill, where the proof saw it


async def continues(
    ask: Ask,
    engine: str,
    model: str | None,
    may_generate: bool,
    template: ChatTemplate | None = None,
) -> Proof:
    """Whether the server continues a partial assistant message, how, and why that is
    known; `template`: its model's chat template, where the addon has it (for the text
    completion way). Its engine's routes are asked; where they are hidden (a gateway or
    a relay that lets only the OpenAI routes through answers 404), a fallback is judged
    by how it behaves instead. Raises what a question raised (ERRORS)."""
    try:
        return await _by_engine(ask, engine, model, may_generate, template)
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code not in HIDDEN or not may_generate:
            raise
        found = await _by_behaviour(ask, model)
        return replace(found, why=f"its {engine} routes are hidden ({failed(exc)}); {found.why}")


HIDDEN = (404, 405)  # what a route a relay does not let through answers


async def _by_behaviour(ask: Ask, model: str | None) -> Proof:
    found = await behaviour(ask, model)
    way = TRAILING_MESSAGE if found.continues else None
    return Proof(found.continues, found.why, way, by_behaviour=True, echoes=found.echoes)


async def _by_engine(
    ask: Ask, engine: str, model: str | None, may_generate: bool, template: ChatTemplate | None
) -> Proof:
    if engine == "llama-server":
        return await _rendered_open(ask, None)
    if not may_generate:
        # (A router would load the model to render the chat: that is not nothing.)
        return Proof(None, "not checked: a primary is asked nothing that generates")
    if engine == ROUTER:
        return await _rendered_open(ask, model)
    if tokenize_request(engine, "") is None:
        return await _by_behaviour(ask, model)  # nothing to ask but its chat route
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


# The chats a llama-server's rendering is checked on besides a plain one: a system
# message, earlier turns, a tool call and its result, content parts.
SYSTEM = {"role": "system", "content": "Answer briefly."}
CALLED = {
    "role": "assistant", "content": "",
    "tool_calls": [{"id": "c1", "type": "function",
                    "function": {"name": "f", "arguments": '{"x": 1}'}}],
}  # fmt: skip
PROOF_CHATS = {
    "a system message": [SYSTEM, USER],
    "earlier turns": TWO_TURNS,
    "a tool call": [USER, CALLED, {"role": "tool", "tool_call_id": "c1", "content": "2"}, USER],
    "content parts": [{"role": "user", "content": [{"type": "text", "text": "Continue."}]}],
}
TEXT_ROUTE = "answers go on as a text completion of its own rendering of the request"


async def _rendered_open(ask: Ask, model: str | None) -> Proof:
    """Whether the server's template renders a chat that ends in a partial assistant
    message as what the model saw: its rendering of the chat without it (generation
    prompt included) followed by the message's text. Where it does not, a text
    completion of its own rendering and the text goes on instead (handoff/nextleg.py
    checks which holds again for each answer, and says so); where the server cannot
    render a plain chat, it continues nothing."""
    render = _renderer(ask, model)
    truth = await render([USER])
    continued = await render([USER, _assistant(SPACED)])
    if truth is None or continued is None:
        return Proof(False, "its /apply-template does not render a chat")
    trims = continued == truth + PARTIAL
    if not trims and (why := _parted(continued, truth + SPACED)) is not None:
        why = f"{TEXT_ROUTE} (a trailing assistant message {why})"
        return Proof(True, why, OWN_RENDERING, trims=not continued.endswith(SPACED))
    why = "a trailing assistant message renders what the model saw (/apply-template)"
    return Proof(True, why + (TRIMS if trims else ""), TRAILING_MESSAGE, trims=trims)


def _parted(rendered: str, expected: str) -> str | None:
    """How a trailing message's rendering parts from what the model saw, for a person."""
    if rendered == expected:
        return None
    if rendered.startswith(expected):
        return f"is closed: {rendered[len(expected) :][:40]!r} follows it"
    at = parting_at(rendered, expected)
    return f"renders {rendered[at : at + 30]!r} where the model saw {expected[at : at + 30]!r}"


def _renderer(ask: Ask, model: str | None) -> Callable[[list[Any]], Awaitable[str | None]]:
    named: dict[str, Any] = {"model": model} if model else {}

    async def render(messages: list[Any]) -> str | None:
        prompt = (await ask("/apply-template", {**named, "messages": messages}))["prompt"]
        return prompt if isinstance(prompt, str) else None

    return render


async def shapes_rendered_open(ask: Ask, model: str | None) -> str:
    """Which of the PROOF_CHATS a llama-server's trailing message renders as the model
    saw them, and which not, for its status (asked after the proof: each answer is
    checked again in its own shape anyway)."""
    render = _renderer(ask, model)
    held, failed = [], []
    for name, chat in PROOF_CHATS.items():
        try:
            before, after = await render(chat), await render([*chat, _assistant(PARTIAL)])
        except httpx.HTTPStatusError:
            continue  # a template that cannot render the shape: requests of it are refused
        if before is not None and after == before + PARTIAL:
            held.append(name)
        else:
            failed.append(name)
    said = f"; checked with {', '.join(held)}" if held else ""
    if failed:
        said += f"; not with {' or '.join(failed)} ({TEXT_ROUTE} there)"
    return said


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
