"""What the model saw and what it wrote: the truth a continuation is checked against
right before it is sent.

The model saw its engine's rendering of the client's request as sent (its template with
the request's tools, kwargs and generation prompt: formats/rendering.py), and went on
from there with its raw output. A faithful continuation is the next engine's own
rendering of that same request followed by that raw output. A trailing assistant message
is one way to ask for it, but a template may render one otherwise: close the turn, open
a reasoning block the model never wrote, move the system prompt, trim the text. So the
rendering a trailing message gets is compared with the truth each time; where they
differ, the truth itself goes as a text completion, or the answer does not go there.

The client's own prefill is the text of its request. Whether the first server sent it
back at the start of the answer is known from the request and the engine
(`prefill_echoed`), never guessed from the text: an answer may begin with the
prefill's own words.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from addon.formats.continuation import prefill_of
from addon.formats.dialect import after_echo
from addon.formats.rendering import parting_at
from addon.formats.transcript import Transcript
from addon.servers.engines import RENDERS_ON_ASKING
from addon.servers.info import ServerInfo

CONTEXT = 24  # characters shown on each side of where two prompts part
# A template's marker: a tag (<think>, </think>, <|channel|>, [THINK], DeepSeek's with
# full-width bars), where one ending in "|>" may be followed by a bare name
# (gpt-oss's <|start|>assistant<|channel|>final<|message|>). Runs of them, and
# whitespace, are all a template may write between the prompt and the reasoning; a word
# there is one the model never wrote.
_TAG = r"(?:<[^<>\s]+>|\[[^\[\]\s]+\])"
_MARKERS = re.compile(rf"(?:{_TAG}(?:(?<=\|>)[A-Za-z_][\w.-]*)?)+")
_CLOSES = re.compile(r"</|\[/|<\|end")  # a marker that closes a block: </think>, [/THINK]
HIDDEN_CLOSE = (
    "the model closed its reasoning with tokens the client never saw (its server's "
    "reasoning parser hid the tag, and any whitespace around it, from every chunk, and "
    "sent no ids for them): what it wrote there is not known, so the answer cannot go "
    "on from it"
)


@dataclass(frozen=True)
class Written:
    text: str  # what the model wrote after its prompt (the client's prefill not included)
    exact: bool  # its tokens' own bytes; else the text as the client received it


def written(transcript: Transcript, prefill: str) -> Written:
    """What the model wrote so far: its tokens' bytes where the server gave every one
    (Transcript.raw_output), else the delivered text, less the client's `prefill` (as
    its request holds it) where the first server sent that back first."""
    if (raw := transcript.raw_output()) is not None:
        return Written(raw, True)
    return Written(after_echo(transcript.text, prefill, transcript.prefill_echoed), False)


def delivered_written(body: dict[str, Any], transcript: Transcript) -> str:
    """What the model wrote as the client received it: the delivered text, less the
    client's prompt where a text completion asked for it back (`echo`), or less its
    prefill where the first server sent that back first."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return transcript.text.removeprefix(prompt) if body.get("echo") is True else transcript.text
    return after_echo(transcript.text, prefill_of(body) or "", transcript.prefill_echoed)


def prefill_echoed(body: dict[str, Any], info: ServerInfo) -> bool | None:
    """Whether the server `info` describes sends the client's assistant prefill in `body`
    back at the start of its streamed answer (None: not known). llama-server does on
    every route (a plain trailing message), not for `continue_final_message`; vLLM only
    where the request asks `echo`; llama-cpp-python opens a new turn instead. Any other
    engine as its start-up probe found."""
    if not _has_prefill(body):
        return False
    if info.engine in RENDERS_ON_ASKING:
        if body.get("continue_final_message"):
            return False
        return True if info.echoes_prefill is None else info.echoes_prefill
    if info.engine == "vllm":
        return body.get("echo") is True
    if info.engine == "llama-cpp-python":
        return False
    return info.echoes_prefill


def _has_prefill(body: dict[str, Any]) -> bool:
    """Whether the request ends with the client's own assistant message (chat, Messages
    and Ollama's `messages`, Responses' `input` items)."""
    for name in ("messages", "input"):
        items = body.get(name)
        if isinstance(items, list) and items and isinstance(items[-1], dict):
            return items[-1].get("role") == "assistant"
    return False


def parting(rendered: str, expected: str) -> str | None:
    """Where `rendered` parts from `expected`, for a person; None where they are equal."""
    if rendered == expected:
        return None
    at = parting_at(rendered, expected)
    start = max(0, at - CONTEXT)
    return (
        f"at character {at} the model saw {expected[start : at + CONTEXT]!r}, "
        f"a trailing message renders {rendered[start : at + CONTEXT]!r}"
    )


def reasoning_parting(rendered: str, truth: str, transcript: Transcript) -> str | None:
    """Where a trailing message's `rendered` prompt fails what can be known of an answer
    with reasoning, whose markers the client never saw (so the raw output is not known
    byte for byte): it must be the `truth` prompt, then the reasoning, once, at its end,
    with only the template's markers and whitespace between (no words, no block closed
    first). Once the reasoning has closed and the content begun, what the model wrote
    between the two is not known at all (HIDDEN_CLOSE). None where it holds."""
    if transcript.content:
        return HIDDEN_CLOSE
    if not rendered.startswith(truth):
        return parting(rendered[: len(truth)], truth)
    rest = rendered[len(truth) :]
    reasoning = transcript.reasoning_text
    at = rest.find(reasoning.strip())
    if at < 0:
        return "a trailing message's prompt does not hold the answer's reasoning"
    opening, after = rest[:at], rest[at + len(reasoning.strip()) :]
    if (word := _word(opening)) is not None:
        return f"a trailing message's prompt writes {word!r} before the reasoning"
    if _CLOSES.search(opening):
        return f"a trailing message's prompt holds another reasoning block first: {opening!r}"
    if not rest.endswith(reasoning) or after.strip():
        return (
            "a trailing message's prompt does not end with the reasoning the model is "
            f"still writing: {rest[-2 * CONTEXT :]!r}"
        )
    return None


def _word(between: str) -> str | None:
    """The first text in `between` that is neither a marker nor whitespace (None: none)."""
    return next((run for run in between.split() if not _MARKERS.fullmatch(run)), None)
