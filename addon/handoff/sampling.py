"""Sampling a vLLM target would not apply as the primary did, so that its continuation is
not the one the model would have written (vLLM 0.32's `SamplingParams`, read here):

- its presence and frequency penalties count the tokens it generated itself, never the
  prompt, so after a cut they start over from nothing;
- llama.cpp's own samplers (`repeat_penalty`, DRY, mirostat, XTC, typical) it does not
  have: it ignores the fields, where a llama-server primary sampled under them.
"""

from __future__ import annotations

from typing import Any

STARTS_OVER = ("presence_penalty", "frequency_penalty")
# llama.cpp's fields that switch a sampler on, each with the value that leaves it off.
LLAMA_CPP_ONLY = {
    "repeat_penalty": 1.0, "dry_multiplier": 0.0, "mirostat": 0, "xtc_probability": 0.0,
    "typical_p": 1.0,
}  # fmt: skip


def vllm_differs(body: dict[str, Any], produced: int, primary_engine: str | None) -> str | None:
    """Why a vLLM server would not sample the rest of this answer as it was sampled
    (`produced` tokens so far, by a primary of `primary_engine`); None where it would."""
    if produced:
        for name in STARTS_OVER:
            if _number(body.get(name), 0.0):
                return (
                    f"vLLM counts {name} over the tokens it generated itself: after the cut "
                    "it would start over from nothing"
                )
    if primary_engine == "vllm":
        return None  # it ignored them too
    for name, off in LLAMA_CPP_ONLY.items():
        if _number(body.get(name), off):
            return f"vLLM has no {name} (llama.cpp's): it would ignore it after the cut"
    return None


def _number(value: Any, off: float) -> bool:
    """Whether `value` is a number other than `off` (a sampler switched on)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value != off
