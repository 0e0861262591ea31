"""The check of a trailing message's rendering for an answer with reasoning whose raw
output is not known byte for byte (the client never saw its markers): the rendering must
be the truth, the reasoning, something that closes it, and the content, nothing else.
Renderings shaped as llama.cpp's templates write them, and the ways a template can part
from what the model wrote."""

from __future__ import annotations

import pytest

from addon.formats.transcript import Transcript
from addon.handoff.seen import reasoning_parting

SAW = "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n"
REASONING = "The river runs north"
CONTENT = "Once upon a time"


def answer(reasoning: str = REASONING, content: str = CONTENT) -> Transcript:
    return Transcript(reasoning=[reasoning], content=[content] if content else [])


@pytest.mark.parametrize(
    ("saw", "rest"),
    [
        (SAW + "<think>\n", f"{REASONING}\n</think>\n\n{CONTENT}"),  # opened by the prompt
        (SAW, f"<think>\n{REASONING}\n</think>\n\n{CONTENT}"),  # opened in the message
    ],
)
def test_what_a_template_writes_for_the_model_passes(saw: str, rest: str) -> None:
    assert reasoning_parting(saw + rest, saw, answer(), "") is None


@pytest.mark.parametrize(
    ("rest", "said"),
    [
        (f"{REASONING} {CONTENT}", "with nothing that closes it"),
        (f"<think>\n\n</think>\n\n<think>\n{REASONING}\n</think>\n\n{CONTENT}",
         "another reasoning block first"),
        (f"</think>\n\n{CONTENT}", "does not hold the answer's reasoning"),
        (f"{REASONING}\n</think>\n\n{CONTENT}<|im_end|>", "does not end with the answer"),
    ],
)  # fmt: skip
def test_a_rendering_that_parts_from_the_model_is_refused(rest: str, said: str) -> None:
    why = reasoning_parting(SAW + rest, SAW, answer(), "")
    assert why is not None and said in why, why


def test_reasoning_still_open_must_end_the_rendering() -> None:
    thinking = answer(content="")
    assert reasoning_parting(SAW + REASONING, SAW, thinking, "") is None
    why = reasoning_parting(SAW + REASONING + "\n</think>\n\n", SAW, thinking, "")
    assert why is not None and "closes the reasoning the model is still writing" in why
