"""Whether a server that cannot be asked what it reads (a hosted API, LM Studio, TGI, a
gateway: no `/tokenize`, no `/apply-template`, no `/props`) continues a partial assistant
message, found from how it behaves, through its OpenAI chat route alone.

A prefill whose only right continuation is known: the server's own greedy answer to a
counting question. It is asked for that answer, then asked again with the first half of
it as a trailing assistant message. A server that continues the message writes the
second half (its own greedy continuation of the same text); one that echoes writes the
first half again, then the second; one that closes the message and opens a new turn
writes something else, most often the answer from its start again. Only the words right
after the cut are compared: a real model counts there without a near tie, and no server
is asked anything beyond the chat route every OpenAI-compatible server has.

A server whose sampling is not greedy at temperature 0, or that cannot count, fails the
probe though it may continue: its operator may still declare how it continues
(`spillover_continue_by`), and the status then says the probe disagrees.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from addon.formats.shape import mapping

Ask = Callable[[str, Any], Awaitable[Any]]
QUESTION = {"role": "user", "content": "Count from 1 to 60, separated by commas."}
ANSWER_TOKENS = 32
CONTINUED_TOKENS = 12
COMPARED = 6  # characters of the known continuation compared (about two numbers)
SAID = 40  # characters of an answer shown in a reason


@dataclass(frozen=True)
class Behaviour:
    continues: bool | None  # None: could not be told
    echoes: bool
    why: str


async def behaviour(ask: Ask, model: str | None) -> Behaviour:
    """How the server treats a trailing assistant message, from its chat route alone.
    Raises what a question raised."""
    whole = await _answer(ask, [QUESTION], model, ANSWER_TOKENS)
    cut = _cut(whole)
    if cut is None:
        return Behaviour(None, False, f"not checked: its answer to a probe is too short: {whole!r}")
    prefill, rest = whole[:cut], whole[cut:]
    asked = [QUESTION, {"role": "assistant", "content": prefill}]
    try:
        then = await _answer(ask, asked, model, CONTINUED_TOKENS)
    except httpx.HTTPStatusError as exc:
        if not 400 <= exc.response.status_code < 500:
            raise
        said = exc.response.text[: SAID * 3].strip()
        return Behaviour(False, False, f"it refuses a partial answer (HTTP "
                                       f"{exc.response.status_code}: {said})")  # fmt: skip
    known = rest[:COMPARED]
    shown = f"asked to go on from {prefill[-SAID:]!r}, it wrote {then[:SAID]!r}"
    if then.startswith(known):
        why = "a trailing assistant message is continued (probe: its own answer goes on)"
        return Behaviour(True, False, why)
    if then.startswith(prefill) and then[len(prefill) :].startswith(known):
        why = "a trailing assistant message is continued and echoed first (probe)"
        return Behaviour(True, True, why)
    if then.lstrip().startswith(whole.lstrip()[:COMPARED]):
        return Behaviour(False, False, f"it starts the answer over after a partial one ({shown})")
    return Behaviour(
        False,
        False,
        f"it does not go on with a partial answer ({shown}, its own goes on {known!r})",
    )


def _cut(text: str) -> int | None:
    """Where the answer is cut for the probe: at the space nearest its middle, with
    enough on both sides to compare, and before any lone surrogate (half a character a
    server sent as an escape: the prefill goes back as JSON, which cannot carry it)."""
    whole = next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), len(text))
    spaces = [i for i, c in enumerate(text[:whole]) if c == " " and 4 <= i <= len(text) - COMPARED]
    if not spaces:
        return None
    return min(spaces, key=lambda i: abs(i - len(text) // 2))


async def _answer(ask: Ask, messages: list[dict[str, str]], model: str | None, tokens: int) -> str:
    body: dict[str, Any] = {"messages": messages, "max_tokens": tokens, "temperature": 0}
    if model:
        body["model"] = model
    reply = await ask("/v1/chat/completions", body)
    choices = mapping(reply).get("choices")
    message = mapping(choices[0]).get("message") if isinstance(choices, list) and choices else None
    content = mapping(message).get("content")
    if not isinstance(content, str):
        raise ValueError(f"no text in its answer: {reply!r:.200}")
    return content
