"""Two questions that tell how a server reads and writes: its tokenizer's fingerprint
(token ids go only to a server that reads them the same way) and whether it writes a
trailing assistant message's text again at the start of its answer."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

from addon.formats.continuers import Continuer
from addon.formats.shape import mapping
from addon.servers.info import ServerInfo

MARKER = "Zq7 "
# Text that exercises a tokenizer: words, digits, punctuation, accents, CJK, emoji and
# the special tokens of common chat templates.
TOKENIZER_PROBE = (
    "The quick brown fox, 1234567 über naïve café; 東京 🙂 <|im_start|><|im_end|><s></s>"
    "<|begin_of_text|><|eot_id|><start_of_turn><end_of_turn>\n\t  x"
)


async def tokenizer_fingerprint(
    ask: Callable[[str, Any], Awaitable[Any]], info: ServerInfo, models: Any
) -> str | None:
    """A fingerprint of the model's tokenizer, from its engine, its vocabulary's kind
    and size (llama-server's `/v1/models` says them) and the ids it makes of a probe
    text (two engines' ids never count as the same: their tokenizers differ)."""
    if not _vllm(info) and "n_vocab" not in _meta(models):
        return None
    return fingerprint_of(info, models, (await ask(*tokenizer_probe(info)))["tokens"])


def tokenizer_probe(info: ServerInfo) -> tuple[str, dict[str, Any]]:
    """The question whose ids go into the tokenizer's fingerprint."""
    if _vllm(info):
        return "/tokenize", {
            "model": info.model, "prompt": TOKENIZER_PROBE, "add_special_tokens": False
        }  # fmt: skip
    return "/tokenize", {"content": TOKENIZER_PROBE}


def fingerprint_of(info: ServerInfo, models: Any, ids: Any) -> str | None:
    """`tokenizer_fingerprint` from its answers: `/v1/models` and the probe's ids."""
    if _vllm(info):
        fingerprint = f"vllm/{ids}"
    elif "n_vocab" in (meta := _meta(models)):
        fingerprint = f"{meta.get('vocab_type')}/{meta['n_vocab']}/{ids}"
    else:
        return None
    return hashlib.sha256(fingerprint.encode()).hexdigest()[:16]


def _vllm(info: ServerInfo) -> bool:
    return info.engine == "vllm" and bool(info.model)


def _meta(models: Any) -> dict[str, Any]:
    entries = mapping(models).get("data") or [None]
    return mapping(mapping(entries[0]).get("meta"))


async def echoes_prefill(
    ask: Callable[[str, Any], Awaitable[Any]], model: str | None, way: Continuer
) -> bool:
    """Whether the server writes a trailing assistant message's text again at the start of
    its answer (some llama-server builds do): knowing keeps the splice from dropping real
    text that merely looks like it."""
    body: dict[str, Any] = {"model": model} if model else {}
    body |= {
        "messages": [
            {"role": "user", "content": "Continue."},
            {"role": "assistant", "content": MARKER},
        ],
        "max_tokens": 1,
        "temperature": 0,
        "cache_prompt": False,  # nothing of it stays in the server's prompt cache
    }
    reply = await ask("/v1/chat/completions", way.ask(body))
    try:
        text = reply["choices"][0]["message"]["content"] or ""
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"unexpected answer: {reply!r:.200}") from exc
    return str(text).startswith(MARKER)
