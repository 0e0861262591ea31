"""The check of a trailing message's rendering for an answer with reasoning whose raw
output is not known byte for byte (the client never saw its markers): the rendering must
be the truth, then the reasoning, once, at its end, with only the template's markers and
whitespace before it; once the reasoning has closed and the content begun, what the model
wrote between the two is not known, and the answer does not go on from it. Renderings
shaped as llama.cpp's templates write them, and the ways a template can part from what
the model wrote."""

from __future__ import annotations

import pytest

from addon.formats.transcript import Transcript
from addon.handoff.seen import HIDDEN_CLOSE, reasoning_parting

SAW = "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n"
REASONING = "The river runs north"
CONTENT = "Once upon a time"


def answer(reasoning: str = REASONING, content: str = "") -> Transcript:
    return Transcript(reasoning=[reasoning], content=[content] if content else [])


@pytest.mark.parametrize(
    ("saw", "rest"),
    [
        (SAW + "<think>\n", REASONING),  # opened by the prompt
        (SAW, f"<think>\n{REASONING}"),  # opened in the message
        (SAW, f"<|channel|>analysis<|message|>{REASONING}"),  # gpt-oss's markers
    ],
)
def test_what_a_template_writes_for_the_model_passes(saw: str, rest: str) -> None:
    assert reasoning_parting(saw + rest, saw, answer()) is None


@pytest.mark.parametrize(
    ("rest", "said"),
    [
        (f"</think>\n\n{REASONING}", "another reasoning block first"),
        (f"<think>\n\n</think>\n\n<think>\n{REASONING}", "another reasoning block first"),
        ("<think>\n", "does not hold the answer's reasoning"),
        (f"{REASONING}\n</think>\n\n", "does not end with the reasoning"),
        (f"{REASONING}<|im_end|>", "does not end with the reasoning"),
        # Words the model never wrote, before its reasoning...
        (f"Thinking it over: <think>\n{REASONING}", "writes 'Thinking'"),
        (f"<think>\nLet me see.\n{REASONING}", "writes 'Let'"),
        # ...and the reasoning rendered twice.
        (f"<think>\n{REASONING}\n{REASONING}", "does not end with the reasoning"),
        (f"<think>\n{REASONING}</think><think>\n{REASONING}", "does not end with the reasoning"),
    ],
)
def test_a_rendering_that_parts_from_the_model_is_refused(rest: str, said: str) -> None:
    why = reasoning_parting(SAW + rest, SAW, answer())
    assert why is not None and said in why, why


@pytest.mark.parametrize(
    "rest",
    [
        f"<think>\n{REASONING}\n</think>\n\n{CONTENT}",  # what Qwen3's template writes
        f"<think>\n{REASONING}\n</think>\n\nAnswer below, as the user asked: {CONTENT}",
        f"{REASONING}</think>{CONTENT}",
    ],
)
def test_an_answer_past_its_reasoning_is_refused_whatever_the_rendering(rest: str) -> None:
    """The tag that closed the reasoning, and the whitespace around it, came in no chunk:
    even a rendering that looks right may not be what the model wrote."""
    assert reasoning_parting(SAW + rest, SAW, answer(content=CONTENT)) == HIDDEN_CLOSE
