"""The check a continuation gets where its server cannot be asked what it reads (a server
proven by its behaviour, or declared by its operator): its first words are held until
they show it went on with the answer, and not started it over (its first words are the
answer's first words again) or opened a new turn (a chat template's turn marker in the
text). Either ends the leg before any of it reaches the client, with the reason.

Held chunks are let out as they came, every field of their deltas with them: a
continuation that goes straight to a tool call (no words to judge, held to its end)
reaches the client's tool-call hold (formats/toolcalls.py) piece by piece, and its
reasoning and role in their place."""

from __future__ import annotations

from typing import Any

from addon.formats.dialect import Rewriter

COMPARED = 12  # characters of the answer's start a continuation must not begin with
TURN_MARKERS = (
    "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|eot_id|>", "<start_of_turn>",
    "<end_of_turn>", "<|assistant|>", "<|user|>", "<|end|>", "[INST]", "</s>",
)  # fmt: skip


class NotAContinuation(Exception):
    """A continuation leg's text shows it is not the answer going on; the message says why."""


def checkable(answer: str) -> bool:
    """Whether `answer` is long enough for a continuation's first words to be told from
    the answer started over (a shorter opening could begin a real continuation too)."""
    return len(answer.lstrip()) >= COMPARED


class StartOverGuard:
    """Wraps a chat continuation's rewriter (of an answer `checkable`): chunks are held
    until the leg's text is long enough to judge (or the leg ends), then let out in
    order. Raises NotAContinuation."""

    def __init__(self, rewriter: Rewriter, answer: str, server: str) -> None:
        self._rewriter = rewriter
        self._opening = answer.lstrip()[:COMPARED]
        self._server = server
        self._held: list[dict[str, Any]] = []
        self._text = ""
        self._decided = False

    def rewrite(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunks the client may have now: none while the first words are held."""
        chunk = self._rewriter.rewrite(chunk)
        if chunk is None:
            return []
        if self._decided:
            return [chunk]
        choices = chunk.get("choices") or []
        self._text += _text(chunk)
        self._held.append(chunk)
        ended = any(c.get("finish_reason") is not None for c in choices) or "usage" in chunk
        if (marker := next((m for m in TURN_MARKERS if m in self._text), None)) is not None:
            raise NotAContinuation(
                f"{self._server} opened a new turn instead of going on ({marker!r} in "
                f"{self._text[:60]!r})"
            )
        if len(self._text.lstrip()) < COMPARED and not ended:
            return []
        if self._text.lstrip().startswith(self._opening):
            raise NotAContinuation(
                f"{self._server} started the answer over instead of going on (it wrote "
                f"{self._text[:60]!r})"
            )
        self._decided = True
        held, self._held = self._held, []
        return held


def _text(chunk: dict[str, Any]) -> str:
    return "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or [])
