"""Continuing a chat answer on a server whose chat route cannot: a text completion
(`/v1/completions`) of the model's own chat prompt, rendered here from its template
(formats/template.py), followed by the answer so far. A text completion simply goes on
from its prompt; its chunks are turned back into chat chunks of the client's stream.
The server is used so only once its chat route and its text completions are seen to
read the same prompt (servers/proof.py).
"""

from __future__ import annotations

import copy
from typing import Any

from addon.formats.continuation import CHAT_ONLY, ChunkRewriter, token_limit
from addon.formats.shape import mapping, text_of
from addon.formats.template import ChatTemplate

PATH = "/v1/completions"


def completion_body(continued: dict[str, Any], template: ChatTemplate) -> dict[str, Any]:
    """The text completion that goes on from `continued`, a chat continuation whose last
    message is the assistant's answer so far. Raises NoTemplate."""
    *earlier, partial = continued["messages"]
    kwargs = mapping(continued.get("chat_template_kwargs"))
    prompt = template.render(earlier, **kwargs) + (text_of(partial.get("content")) or "")
    return text_completion(continued, prompt, token_limit(continued))


def text_completion(
    chat: dict[str, Any], prompt: str | list[int], max_tokens: int | None
) -> dict[str, Any]:
    """A streamed `/v1/completions` request of `prompt` (text or token ids) with the chat
    request's sampling settings. Its limit is always named: `max_tokens` left, or, where
    the client set none, null, which vLLM and llama-cpp-python read as the rest of their
    context (their text route's default is 16 tokens, where a chat answer has none)."""
    # `echo` would send back the prompt, rendered or as ids: the client has had its echo.
    body = {k: copy.deepcopy(v) for k, v in chat.items() if k not in (*CHAT_ONLY, "echo")}
    return body | {"prompt": prompt, "stream": True, "max_tokens": max_tokens}


class CompletionRewriter:
    """A text completion leg's chunks as chunks of the client's chat stream."""

    def __init__(self, rewriter: ChunkRewriter) -> None:
        self._rewriter = rewriter

    def rewrite(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        choices = []
        for choice in chunk.get("choices") or []:
            delta = {"content": choice["text"]} if choice.get("text") else {}
            choices.append(
                {"index": choice.get("index", 0), "delta": delta,
                 "finish_reason": choice.get("finish_reason")}
            )  # fmt: skip
        chat = {**chunk, "object": "chat.completion.chunk", "choices": choices}
        return self._rewriter.rewrite(chat)
