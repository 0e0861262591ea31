"""Token-exact replay between vLLM servers: the first leg is asked for the ids behind its
text (`return_token_ids`, taken out again unless the client asked for them), and the
next vLLM goes on from its own token ids of the chat prompt (its `/tokenize` renders the
messages) followed by the answer's ids, as a token-id prompt on `/v1/completions`.

vLLM holds back text (half of a character, the start of a stop string) while its ids go
out: the transcript treats ids whose text has not arrived as unknown (fail closed), and
an answer with stop strings is replayed as text.
"""

from __future__ import annotations

from typing import Any

from addon.formats.continuation import token_limit
from addon.handoff.rendered import text_completion

ENGINE = "vllm"


def may_ask_for_ids(body: dict[str, Any]) -> bool:
    """Whether asking for ids changes nothing the client decides: it did not set
    `return_token_ids` itself, and no stop string makes vLLM hold text back."""
    return "return_token_ids" not in body and not body.get("stop")


def client_wants_ids(body: dict[str, Any]) -> bool:
    return body.get("return_token_ids") is True


def asking_for_ids(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "return_token_ids": True}


def native_body(
    body: dict[str, Any], prompt: list[int], produced: int, context: int
) -> dict[str, Any]:
    """A text completion that goes on from `prompt` (the chat prompt's ids, then the
    answer's), with the chat request's sampling settings. Where the client set no limit,
    the rest of the server's `context`: vLLM's text route reads a null `max_tokens` as
    its default, 16 tokens, where its chat route goes on to the end of the context."""
    limit = token_limit(body)
    left = context - len(prompt) if limit is None else max(1, limit - produced)
    native = text_completion(body, prompt, max(1, left))
    native.pop("return_token_ids", None)
    return native
