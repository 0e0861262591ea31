"""Text completions on the OpenAI text route (`/v1/completions`) that continue a chat
answer: the prompt (text, or token ids) is what the model saw followed by what it wrote
(handoff/builder.py); the completion simply goes on from it, and its chunks are turned
back into chat chunks of the client's stream.
"""

from __future__ import annotations

import copy
from typing import Any

from addon.formats.continuation import CHAT_ONLY, ChunkRewriter
from addon.formats.shape import mapping, positive_int

PATH = "/v1/completions"


def text_completion(
    chat: dict[str, Any], prompt: str | list[int], max_tokens: int | None
) -> dict[str, Any]:
    """A streamed `/v1/completions` request of `prompt` (text or token ids) with the chat
    request's sampling settings. Its limit is always named: `max_tokens` left, or, where
    the client set none, the caller's (null: llama-cpp-python reads it as the rest of its
    context, where its text route's default is 16 tokens; vLLM does not, see
    handoff/vllm.py).
    The client's `stream_options` go along (usage at the end), and its logprobs are asked
    in the text route's terms (`CompletionRewriter` gives them back in the chat's)."""
    # `echo` would send back the prompt, rendered or as ids: the client has had its echo.
    body = {k: copy.deepcopy(v) for k, v in chat.items() if k not in (*CHAT_ONLY, "echo")}
    if isinstance(options := chat.get("stream_options"), dict):
        body["stream_options"] = copy.deepcopy(options)
    if (top := logprobs_asked(chat)) is not None:
        body["logprobs"] = top
    return body | {"prompt": prompt, "stream": True, "max_tokens": max_tokens}


def logprobs_asked(chat: dict[str, Any]) -> int | None:
    """How many alternatives per token a chat request's client asked for with its
    logprobs (0: only the chosen token's), or None when it asked for none."""
    if chat.get("logprobs") is not True:
        return None
    return positive_int(chat.get("top_logprobs")) or 0


class CompletionRewriter:
    """A text completion leg's chunks as chunks of the client's chat stream; `top` is
    `logprobs_asked` of the client's request."""

    def __init__(self, rewriter: ChunkRewriter, top: int | None = None) -> None:
        self._rewriter = rewriter
        self._top = top

    def rewrite(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        choices = []
        for choice in chunk.get("choices") or []:
            delta = {"content": choice["text"]} if choice.get("text") else {}
            chat_choice = {
                "index": choice.get("index", 0), "delta": delta,
                "finish_reason": choice.get("finish_reason"),
            }  # fmt: skip
            if self._top is not None:
                chat_choice["logprobs"] = chat_logprobs(choice.get("logprobs"), self._top)
            choices.append(chat_choice)
        chat = {**chunk, "object": "chat.completion.chunk", "choices": choices}
        return self._rewriter.rewrite(chat)


def chat_logprobs(logprobs: Any, top: int) -> dict[str, Any] | None:
    """A text completion's logprobs (parallel lists, alternatives as a mapping that holds
    the chosen token too) in a chat chunk's shape: one entry per token, its `top` best
    alternatives listed best first."""
    if not isinstance(logprobs, dict) or not isinstance(tokens := logprobs.get("tokens"), list):
        return None
    chosen = logprobs.get("token_logprobs") or [None] * len(tokens)
    alternatives = logprobs.get("top_logprobs") or [None] * len(tokens)
    content = []
    for token, logprob, others in zip(tokens, chosen, alternatives, strict=False):
        ranked = sorted(mapping(others).items(), key=lambda item: -item[1])[:top]
        content.append(
            _entry(token, logprob) | {"top_logprobs": [_entry(t, lp) for t, lp in ranked]}
        )
    return {"content": content}


def _entry(token: str, logprob: float | None) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
