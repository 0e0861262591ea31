"""The one way a cut chat answer's continuation is built, for every engine that can say
what its model reads.

What the model saw is the next engine's own rendering of the client's original request
(`Terms.saw`); what it wrote is the raw output so far (handoff/seen.py). The truth is the
one followed by the other, in the engine's terms (its text, or its token ids). A
continuation goes on from the truth and from nothing else:

- where the answer's token ids are known and the engine reads them as the model meant
  them, its rendering followed by those ids;
- else, where the engine's chat route reads a trailing assistant message (asked its way;
  on llama-server, placed where its rendering is the truth: handoff/placing.py) as
  exactly the truth, that chat request: its parser keeps reasoning and tool calls;
- else the truth itself on its text route, where it has one and neither tools are
  offered nor reasoning written (a text completion would hand a tool call, or the rest
  of the reasoning, to the client as text);
- else not at all: CannotContinue, saying where the prompts part.

A request that holds media (an image, audio) goes by none of the ways of ids or text:
only a chat route carries its pictures to the next server (handoff/media.py). Every way
but the ids has the engine read what the model wrote as text, with its special tokens
parsed: each is asked first whether that text spells one (handoff/specials.py).

Each engine's terms are one module (handoff/llama_server.py, vllm.py,
llama_cpp_python.py); a new engine is one more.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from addon.formats.dialect import Rewriter, after_echo
from addon.formats.transcript import Transcript
from addon.handoff import media, seen
from addon.servers.prompts import NotRendered

Leg = tuple[str, dict[str, Any], Rewriter]  # path, body, how its chunks are rewritten
UNSEEN = (
    "the model wrote {} tokens the client never saw (what the server's parser keeps, "
    "such as an empty reasoning block): what it wrote is not known"
)
TEXT_ROUTE_AND_TOOLS = "and a text completion would not read tool calls"
TEXT_ROUTE_AND_REASONING = "and a text completion would not read reasoning apart from content"


class CannotContinue(Exception):
    """A server that continues answers cannot continue this one; the message says why."""


@dataclass(frozen=True)
class Prompt:
    """A prompt as an engine reads it: its text where the engine renders text on asking,
    else its token ids. Two prompts are the same when these are equal."""

    text: str | None = None
    ids: tuple[int, ...] | None = None


class Terms(Protocol):
    """One engine's terms for what its model reads, for one answer."""

    url: str

    async def saw(self) -> Prompt:
        """Its rendering of the client's original request. Raises NotRendered."""
        ...

    async def truth(self, saw: Prompt, written: str) -> Prompt:
        """`saw` followed by `written` (what the model wrote). Raises NotRendered."""
        ...

    async def spelled(self, text: str) -> str | None:
        """Why `text` (what the model wrote) cannot be read as text there: it spells one of
        its special tokens, or it cannot say (handoff/specials.py). None: it can."""
        ...

    async def reads(self, chat: dict[str, Any]) -> Prompt | None:
        """What its chat route reads for `chat` (a trailing message, asked its way); None
        where a trailing message is not a way to continue there. Raises NotRendered."""
        ...

    def parting(self, read: Prompt, truth: Prompt) -> str | None:
        """Where `read` parts from `truth`, for a person; None where they are the same."""
        ...

    def text_leg(self, truth: Prompt) -> Leg | None:
        """A text completion of exactly `truth`, where the engine has a text route."""
        ...

    def ids_leg(self, saw: Prompt, ids: list[int]) -> Leg | None:
        """A completion of `saw` followed by the answer's token `ids`, where it can."""
        ...


@runtime_checkable
class Places(Protocol):
    """An engine whose chat route can be asked to read a given prompt exactly (llama-
    server's `continue_final_message`: handoff/placing.py)."""

    async def placed(
        self, chat: dict[str, Any], truth: Prompt, reasoning_open: bool
    ) -> tuple[dict[str, Any] | None, str]:
        """The chat request from `chat` whose prompt there is `truth` (None: where the
        two part)."""
        ...


@runtime_checkable
class Parses(Protocol):
    """An engine that reads a prompt of ids with its own chat parsers, reasoning and
    tool calls included (vLLM's own routes: handoff/vllm_generate.py)."""

    def parsed_leg(self, truth: Prompt) -> Leg | None:
        """The leg that goes on from exactly `truth`, parsed as its chat route parses
        (None where it cannot)."""
        ...


@dataclass
class Answer:
    """The answer being continued, as the builder needs it."""

    transcript: Transcript
    prefill: str  # the client's own assistant prefill ("" without one)
    chat: dict[str, Any]  # its chat continuation: a trailing message, asked the target's way
    tools: bool  # tools were offered
    chat_leg: Callable[[dict[str, Any]], Leg]  # the leg of a chat continuation body


async def build(terms: Terms, answer: Answer, ids: list[int] | None) -> tuple[Leg, str]:
    """The leg that continues `answer` on the server `terms` speaks for, and how it
    replays the answer ("token ids" or "text"); `ids`: the answer's token ids, where the
    server reads them as the model meant them. Raises CannotContinue."""
    try:
        return await _build(terms, answer, ids)
    except NotRendered as why:
        raise CannotContinue(str(why)) from None


async def _build(terms: Terms, answer: Answer, ids: list[int] | None) -> tuple[Leg, str]:
    transcript = answer.transcript
    saw = await terms.saw()
    pictured = media.held(answer.chat, saw.text)  # no leg of ids or text shows it
    if ids is not None and pictured is None and (leg := terms.ids_leg(saw, ids)) is not None:
        return leg, "token ids"
    wrote = seen.written(transcript, answer.prefill)
    texts = (wrote.text,) if wrote.exact else (transcript.reasoning_text, wrote.text)
    for text in texts:  # read as text from here on (the raw output holds the reasoning)
        if (why := await terms.spelled(text)) is not None:
            raise CannotContinue(why)
    if transcript.reasoning and not wrote.exact:
        return await _with_reasoning(terms, answer, saw), "text"
    if transcript.raw_lost:
        raise CannotContinue(UNSEEN.format(transcript.unseen))
    truth = await terms.truth(saw, wrote.text)
    if pictured is None and isinstance(terms, Parses) and (leg := terms.parsed_leg(truth)):
        return leg, "text"
    if isinstance(terms, Places):
        reasoning_open = bool(transcript.reasoning) and not transcript.content
        chat, why = await terms.placed(answer.chat, truth, reasoning_open)
        if chat is not None:
            return answer.chat_leg(chat), "text"
        why = f"{terms.url}: {why}"
    else:
        why = await _trailing_message(terms, answer, wrote, truth)
        if not isinstance(why, str):
            return why, "text"
    if pictured is not None:
        raise CannotContinue(f"{why}; {media.refusal(pictured)}")
    if transcript.reasoning:
        raise CannotContinue(f"{why}; {TEXT_ROUTE_AND_REASONING}")
    if answer.tools:
        raise CannotContinue(f"{why}; {TEXT_ROUTE_AND_TOOLS}")
    if (leg := terms.text_leg(truth)) is None:
        raise CannotContinue(f"{why}, and it has no text route")
    return leg, "text"


async def _trailing_message(
    terms: Terms, answer: Answer, wrote: seen.Written, truth: Prompt
) -> Leg | str:
    """The chat leg whose trailing message the engine reads as exactly `truth`, else why
    none does."""
    why = f"{terms.url}'s chat route does not continue a partial message"
    if (read := await terms.reads(answer.chat)) is None:
        return why
    if (why := terms.parting(read, truth)) is None:
        return answer.chat_leg(answer.chat)
    transcript = answer.transcript
    delivered = after_echo(transcript.text, answer.prefill, transcript.prefill_echoed)
    if wrote.exact and wrote.text != delivered:
        # The primary's parser changed the text (a leading space trimmed): the trailing
        # message may carry what the model wrote instead.
        raw = _carrying(answer.chat, answer.prefill + wrote.text)
        if (read := await terms.reads(raw)) is not None and terms.parting(read, truth) is None:
            return answer.chat_leg(raw)
    return f"{terms.url}: {why}"


async def _with_reasoning(terms: Terms, answer: Answer, saw: Prompt) -> Leg:
    """An answer with reasoning, whose markers the client never saw (the raw output is
    not known byte for byte): only while the reasoning is open (after it closed, what
    the model wrote around its closing tag is not known), and only where a chat route
    renders the trailing message as the truth prompt followed by the reasoning."""
    read = await terms.reads(answer.chat)
    if read is None or read.text is None or saw.text is None:
        raise CannotContinue(
            f"{terms.url} cannot show how it renders this answer's reasoning, whose "
            "markers the client never saw"
        )
    why = seen.reasoning_parting(read.text, saw.text, answer.transcript)
    if why is not None:
        raise CannotContinue(f"{terms.url}: {why}")
    return answer.chat_leg(answer.chat)


def _carrying(chat: dict[str, Any], text: str) -> dict[str, Any]:
    """`chat` whose trailing message carries `text` instead."""
    last = {**chat["messages"][-1], "content": text}
    return {**chat, "messages": [*chat["messages"][:-1], last]}
