"""Sampling fields that name token ids (OpenAI's and llama.cpp's `logit_bias`, vLLM's
`stop_token_ids` and `allowed_token_ids`): ids of the first server's vocabulary, which
are other tokens on a server of another. Such a request goes on only where the next
server's tokenizer is the first's; elsewhere the answer ends with the reason (the ids
have no spelling to translate them by that both engines would read the same way)."""

from __future__ import annotations

from typing import Any

ID_LISTS = ("stop_token_ids", "allowed_token_ids")


def fields_with_ids(body: dict[str, Any]) -> list[str]:
    """The request's fields that name token ids."""
    found = [name for name in ID_LISTS if body.get(name)]
    if _names_ids(body.get("logit_bias")):
        found.insert(0, "logit_bias")
    return found


def _names_ids(bias: Any) -> bool:
    """Whether a `logit_bias` names a token by its id: `{"15": 2}` (OpenAI's), or
    `[[15, 2]]` (llama.cpp's); `[["hello", 2]]` names it by its text."""
    if isinstance(bias, dict):
        return any(str(key).strip().lstrip("-").isdigit() for key in bias)
    if isinstance(bias, list):
        return any(isinstance(pair, list) and pair and isinstance(pair[0], int) for pair in bias)
    return False


def foreign(body: dict[str, Any], first: str, target: str, same_vocabulary: bool) -> str | None:
    """Why `target` cannot go on with a request of `first`'s token ids (None: it can)."""
    if same_vocabulary or not (found := fields_with_ids(body)):
        return None
    return (
        f"the request's {' and '.join(found)} name token ids of {first}'s vocabulary, "
        f"which are other tokens (or none) on {target}"
    )
