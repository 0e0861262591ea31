"""What a splice asks of one API's wire format.

A `Dialect` says how its streams are framed, which requests the addon can carry, how a
later leg is asked to go on in that API's own terms, and how the client learns of a
handoff or a failure. Each leg's events go through a `LegReader`, which sorts them for
the pump (`Step`) and records what the client received in the transcript. One module per
API implements both: chat.py, messages.py, responses.py, ollama.py.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from addon.formats.shape import positive_int, text_of

if TYPE_CHECKING:
    from addon.formats.transcript import Transcript
    from addon.formats.wire import Header


class Step(enum.Enum):
    SEND = "send"  # goes out now
    HOLD = "hold"  # kept back until something is sent after it: it would close what a
    # continuation goes on with (a content block's end), so a cut drops it
    FINISH = "finish"  # the answer's end: it and all that follows are kept until END, and
    # no handoff may cut the answer any more
    END = "end"  # the stream's last event: out with everything kept


@dataclass
class Event:
    step: Step
    data: bytes  # as the client gets it, framing included
    payload: Any = None  # what the transcript records once it is sent (None: nothing)


class Garbled(str):
    """Why a leg failed on an event that is not what its format says: the server's own
    bytes, which go to the client as sent where no other server could go on instead."""


class Splitter(Protocol):
    def feed(self, data: bytes) -> bytes: ...

    def rest(self) -> bytes:
        """What was received after the last complete event."""
        ...


class LegReader(Protocol):
    """One leg's events, as the pump takes them."""

    boundary: bytes  # what ends an event (counted for the leg's pace)

    def splitter(self) -> Splitter: ...

    def events(self, block: bytes) -> list[bytes]: ...

    def plain(self, block: bytes) -> bytes | None:
        """What of the whole block goes out unread (the hot path), the block accounted for
        in the transcript from the one decode that found it plain (formats/blocks.py), or
        None when it is taken event by event."""
        ...

    def take(self, event: bytes) -> list[Event] | str:
        """The event as what goes to the client, or why the leg failed."""
        ...

    def record(self, payload: Any) -> None:
        """Account for a payload the client has received."""
        ...

    def close(self) -> bytes | None:
        """What ends the stream when the server closed it after the answer's end (and
        before its last event); None when the answer is not over."""
        ...


class Rewriter(Protocol):
    """Turns a continuation leg's payloads into the client's stream."""

    def rewrite(self, payload: Any) -> Any: ...


@runtime_checkable
class Adapter(Protocol):
    """A rewriter whose leg's body is turned into the dialect's stream first (vLLM's
    generate chunks, derendered into chat chunks: handoff/vllm_generate.py)."""

    def adapt(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]: ...


class Dialect(Protocol):
    name: str
    # Whether a continuation's room on a server can be measured (a chat prompt the server
    # renders); elsewhere a server that has no room refuses, and the ladder moves on.
    sizes_rooms: bool
    # Whether answers are shadowed (prefilled on the next server, see handoff/shadow.py): chat
    # only. llama-server's Messages route drops `cache_prompt`; Responses and Ollama are
    # not shadowed yet.
    shadowed: bool

    def accepts(self, body: dict[str, Any]) -> bool:
        """Whether a parsed request body is one this dialect can carry."""
        ...

    def streaming(self, body: dict[str, Any]) -> bool: ...

    def limit(self, body: dict[str, Any]) -> int | None:
        """The most tokens the request lets the answer have, when it says."""
        ...

    def upper_bound(self, body: dict[str, Any]) -> int | None:
        """At most this many tokens for the request on any server, by its size (see
        sizes.py); None where only a server can count it."""
        ...

    def reader(
        self,
        transcript: Transcript,
        rewriter: Rewriter | None,
        strip_pieces: str | None,
        server: str,
    ) -> LegReader: ...

    def note(self, text: str) -> bytes | None:
        """A line the client's parser skips, telling it `text`; None where there is none."""
        ...

    def error_end(self, message: str) -> bytes:
        """The in-band error that ends a stream the addon cannot carry on."""
        ...

    def refusal(self, message: str) -> tuple[list[Header], bytes]:
        """A 502's headers and body, before any byte of the answer went out."""
        ...

    def cannot_continue(self, body: dict[str, Any], transcript: Transcript) -> str | None:
        """Why no other server can honestly go on with this answer, or None."""
        ...

    def continues_a_turn(self, body: dict[str, Any]) -> bool:
        """Whether a continuation sends the answer so far as a trailing assistant message,
        which only a server proven to continue one may take (servers/proof.py)."""
        ...

    def continuation(self, body: dict[str, Any], transcript: Transcript) -> dict[str, Any]:
        """The request, asking a server to go on from what the client has received."""
        ...

    def leg_path(self, path: str, continuation: dict[str, Any]) -> str:
        """Where a continuation goes: the client's route, or another of the same server's."""
        ...

    def rewriter(
        self, transcript: Transcript, continuation: dict[str, Any], echo: bool | None
    ) -> Rewriter:
        """How a continuation leg's events join the stream; `echo`: whether its server
        repeats the prefill (None: unknown, decided from the first text)."""
        ...


class EchoStrip:
    """Takes a prefill a server repeats at the start of its answer out of that answer:
    known to echo (in one piece or several), or (unknown) when its first text starts
    with the whole prefill. A first text that merely begins like the prefill is the
    answer's own when the echo is unknown: dropping it could lose text."""

    def __init__(self, prefill: str, echo: bool | None) -> None:
        self._left = prefill if echo is not False else ""
        self._in_pieces = echo is True

    def __call__(self, text: str) -> str:
        echo = self._left
        if not echo:
            return text
        if text.startswith(echo):
            self._left = ""
            return text[len(echo) :]
        if self._in_pieces and echo.startswith(text):
            self._left = echo[len(text) :]
            return ""
        # The answer does not start with the prefill: this server does not echo after all,
        # or an echoing one diverged. Either way, never drop real text.
        self._left = ""
        return text


def with_fewer_tokens(
    body: dict[str, Any], produced: int, fields: tuple[str, ...]
) -> dict[str, Any]:
    """A deep copy of `body`, its token limits lowered by what was produced."""
    body = copy.deepcopy(body)
    for name in fields:
        if (limit := positive_int(body.get(name))) is not None:
            body[name] = max(1, limit - produced)
    return body


def prefilled(
    messages: list[Any],
    delivered: str,
    echoed: bool | None,
    message: Callable[[str], Any],
    read: Callable[[Any], str | None] = text_of,
) -> list[Any]:
    """`messages` with the answer so far as the assistant's message: the client's own
    assistant prefill (its content read by `read`, as the client sent it) followed by what
    the model wrote after it (`delivered` less the prefill where the server sent it back
    first, `echoed`), or a new assistant message made by `message`."""
    last = messages[-1] if messages else None
    if isinstance(last, dict) and last.get("role") == "assistant":
        earlier = read(last.get("content")) or ""
        text = earlier + after_echo(delivered, earlier, echoed)
        return [*messages[:-1], {**last, **message(text)}]
    return [*messages, message(delivered)]


def after_echo(delivered: str, prefill: str, echoed: bool | None) -> str:
    """What the model wrote after the client's `prefill`: the `delivered` text, less the
    prefill where the server is known to have sent it back first (`echoed`; None: not
    known, and such an answer is not continued: `unknown_echo`). Never decided from the
    text: an answer may begin with the prefill's own words."""
    if echoed is not True:
        return delivered
    if prefill.startswith(delivered):
        return ""  # cut inside the echo: nothing written yet
    return delivered.removeprefix(prefill)


def unknown_echo(transcript: Transcript) -> str | None:
    """Why an answer whose first server may have sent the client's prefill back first
    cannot go on (None: it is known whether it did, or nothing was said)."""
    if transcript.prefill_echoed is not None or not transcript.content:
        return None
    server = transcript.legs[0].server if transcript.legs else "the first server"
    return (
        f"whether {server} sent the client's assistant prefill back at the start of its "
        "answer is not known, so what the model wrote after it is not known"
    )


def json_object(event: bytes, parse: Callable[[bytes], Any]) -> dict[str, Any] | str:
    """An event's JSON object, or why it is garbled."""
    try:
        payload = parse(event)
    except ValueError as exc:
        return str(exc)
    return payload if isinstance(payload, dict) else "not a JSON object"


def has_messages(body: dict[str, Any]) -> bool:
    """A list of message objects under `messages` (anything else: the server's own error)."""
    messages = body.get("messages")
    return isinstance(messages, list) and all(isinstance(m, dict) for m in messages)
