"""vLLM's chat route in its own pieces (servers/vllm_routes.py), where it serves them: the
truth's token ids (its rendering of the original request, then what the model wrote) go
to `/inference/v1/generate` with the sampling its render resolved for that request, and
each chunk it streams goes through `/v1/chat/completions/derender` with the original
request and the whole prompt, so vLLM's own reasoning and tool-call parsers read the
continuation as they would have read the rest of the first answer (a reasoning block
still open in the prompt goes on as reasoning; one closed there, as content)."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import Any

import httpx

from addon.formats import sse
from addon.formats.continuation import ChunkRewriter
from addon.servers.prompts import Ask
from addon.servers.vllm_routes import DERENDER, GENERATE

SEP = sse.TERMINATOR
# What a derendered chunk carries that vLLM's own chat chunk leaves out when empty.
_EMPTY_EXTRAS = ("metrics", "system_fingerprint")
# The continuation's own prompt, which is not the client's.
_PROMPT = ("prompt_token_ids", "prompt_text")


def generate_body(rendered: dict[str, Any], prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A streamed generate request of `prompt` with what vLLM's render of the original
    request resolved (sampling, parser flags), `max_tokens` left. Its `reasoning_ended`
    was the original prompt's: the engine settles it from this prompt itself."""
    body = {
        k: copy.deepcopy(v)
        for k, v in rendered.items()
        if k not in ("request_id", "reasoning_ended")
    }
    body["sampling_params"] = {**body.get("sampling_params", {}), "max_tokens": max_tokens}
    return body | {"token_ids": prompt, "stream": True, "output_mode": "tokens"}


class Derendered:
    """A generate leg's chunks turned into chat chunks by vLLM's derender route (`adapt`,
    which the splice runs over the leg's body), then into the client's stream."""

    def __init__(
        self,
        ask: Ask,
        model: str | None,
        chat: dict[str, Any],
        prompt: list[int],
        rewriter: ChunkRewriter,
        asked: int,
    ) -> None:
        """`chat`: the client's original request, as vLLM's parsers are to read it (its
        `return_token_ids` included: the derendered chunks then carry them); `prompt`:
        the ids the leg goes on from; `asked`: how many of them are the client's own
        prompt (its usage's `prompt_tokens`; the rest is the answer replayed)."""
        self._ask = ask
        self._fixed = {
            "stream": True, "prompt_token_ids": prompt, "prompt_tokens": asked,
            "chat_request": {**chat, "model": model} if model else chat,
            **({"model": model} if model else {}),
        }  # fmt: skip
        self._rewriter = rewriter

    def rewrite(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        return self._rewriter.rewrite(chunk)

    async def adapt(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        splitter, state = sse.EventSplitter(), None
        async for data in body:
            try:
                block = splitter.feed(data)
            except sse.EventTooLarge as exc:
                yield _error(f"garbled generate stream: {exc}")
                return
            for event in sse.events(block):
                try:
                    chunk = sse.parse(event)
                except ValueError:
                    chunk = None
                if not isinstance(chunk, dict) or "error" in chunk:
                    yield event + SEP  # [DONE], a comment, an error: the reader judges it
                    continue
                request = {**self._fixed, "generate_chunk": chunk, "stream_state": state}
                try:
                    answer = await self._ask(DERENDER, request)
                    state, chat = answer["stream_state"], _tidy(answer["chunk"])
                    _ended_as_generated(chat, chunk)
                except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                    yield _error(f"{DERENDER} did not read a chunk of {GENERATE}: {exc!r:.200}")
                    return
                yield sse.encode(chat) + SEP


def _tidy(chunk: dict[str, Any]) -> dict[str, Any]:
    """A derendered chunk as vLLM's chat route writes one after its first: no prompt, no
    empty delta fields, extras or per-choice ids left null."""
    for name in _EMPTY_EXTRAS:
        if chunk.get(name) is None:
            chunk.pop(name, None)
    for name in _PROMPT:
        chunk.pop(name, None)
    for choice in chunk.get("choices") or ():
        if choice.get("token_ids") is None:
            choice.pop("token_ids", None)
        delta = choice.get("delta") or {}
        choice["delta"] = {k: v for k, v in delta.items() if v is not None and v != []}
    return chunk


def _ended_as_generated(chat: dict[str, Any], generated: dict[str, Any]) -> None:
    """vLLM's derender says a leg that streamed a tool call ended in `tool_calls`,
    whatever ended it; its chat route says so only where the model stopped, and keeps
    `length` (a call cut by the budget is not a whole call): the generate chunk's own
    reason stands there."""
    ends = [choice.get("finish_reason") for choice in generated.get("choices") or ()]
    for choice, end in zip(chat.get("choices") or (), ends, strict=False):
        if choice.get("finish_reason") == "tool_calls" and end not in (None, "stop"):
            choice["finish_reason"] = end


def _error(message: str) -> bytes:
    return sse.encode({"error": {"message": message, "type": "server_error"}}) + SEP
