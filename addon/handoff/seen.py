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
"""

from __future__ import annotations

from dataclasses import dataclass

from addon.formats.rendering import parting_at
from addon.formats.transcript import Transcript

CONTEXT = 24  # characters shown on each side of where two prompts part


@dataclass(frozen=True)
class Written:
    text: str  # what the model wrote after its prompt (the client's prefill not included)
    exact: bool  # its tokens' own bytes; else the text as the client received it


def written(transcript: Transcript, prefill: str) -> Written:
    """What the model wrote so far: its tokens' bytes where the server gave every one
    (Transcript.raw_output), else the delivered text less an echoed `prefill`."""
    if (raw := transcript.raw_output()) is not None:
        return Written(raw, True)
    return Written(transcript.text.removeprefix(prefill), False)


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


def reasoning_parting(
    rendered: str, truth: str, transcript: Transcript, prefill: str
) -> str | None:
    """Where a trailing message's `rendered` prompt fails what can be known of an answer
    with reasoning, whose markers the client never saw (so the raw output is not known
    byte for byte): it must be the `truth` prompt, then the reasoning and, once the answer
    has content, something that closes it and that content at the end; while it has none,
    the reasoning left open at the end. Between them only markers: no text, no second
    block (the closing marker met again before the reasoning). None where it holds."""
    if not rendered.startswith(truth):
        return parting(rendered[: len(truth)], truth)
    rest = rendered[len(truth) :]
    reasoning, content = transcript.reasoning_text, transcript.text.removeprefix(prefill)
    at = rest.find(reasoning.strip())
    if at < 0:
        return "a trailing message's prompt does not hold the answer's reasoning"
    opening, after = rest[:at], rest[at + len(reasoning.strip()) :]
    if not content:
        if rest.endswith(reasoning):
            return None
        return (
            "a trailing message's prompt closes the reasoning the model is still writing: "
            f"{rest[-2 * CONTEXT :]!r}"
        )
    if not after.endswith(content):
        return f"a trailing message's prompt does not end with the answer: {rest[-2 * CONTEXT :]!r}"
    closing = after[: len(after) - len(content)].strip()
    if not closing:
        return (
            "a trailing message's prompt runs the reasoning into the answer with nothing "
            f"that closes it: {rest[at + len(reasoning.strip()) - CONTEXT :][: 2 * CONTEXT]!r}"
        )
    if closing in opening:
        return f"a trailing message's prompt holds another reasoning block first: {opening!r}"
    return None
