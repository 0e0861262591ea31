"""llama-server's terms (a router's too): it renders any chat request on asking
(`/apply-template`), so what its model saw and what a trailing message would read are
both its own text; its native `/completion` goes on from a text prompt, followed by
token ids where they are known (handoff/exact.py), or from its own ids of that text where
they were asked (handoff/renderings.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from addon.formats.continuation import ChunkRewriter
from addon.formats.shape import mapping
from addon.formats.transcript import Transcript
from addon.handoff import placing, seen, specials
from addon.handoff.builder import Leg, Prompt
from addon.handoff.exact import NativeRewriter, NativeToChat, native_body

Render = Callable[[dict[str, Any]], Awaitable[str]]  # a chat request -> its rendering


class LlamaServerTerms:
    def __init__(
        self,
        url: str,
        model: str | None,
        original: dict[str, Any],
        transcript: Transcript,
        saw: Callable[[], Awaitable[str]],
        render: Render,
        ask: specials.Ask,
        ids_of: Callable[[str], list[int] | None],
        routed: bool = False,
    ) -> None:
        """`saw`: its rendering of `original` (asked once per answer); `render`: its
        rendering of any chat request (both raise NotRendered); `ask`: its own questions;
        `ids_of`: its own ids of a rendering, where had already; `routed`: a router, asked
        about `model`."""
        self.url = url
        self._model = model
        self._original = original
        self._transcript = transcript
        self._saw = saw
        self._render = render
        self._ask = ask
        self._ids_of = ids_of
        self._routed = routed

    async def saw(self) -> Prompt:
        return Prompt(text=await self._saw())

    async def truth(self, saw: Prompt, written: str) -> Prompt:
        return Prompt(text=(saw.text or "") + written)

    async def spelled(self, text: str) -> str | None:
        model = self._model if self._routed else None
        return await specials.spelled(self._ask, self.url, text, model)

    async def reads(self, chat: dict[str, Any]) -> Prompt | None:
        return Prompt(text=await self._render(chat))

    def parting(self, read: Prompt, truth: Prompt) -> str | None:
        return seen.parting(read.text or "", truth.text or "")

    async def placed(
        self, chat: dict[str, Any], truth: Prompt, reasoning_open: bool
    ) -> tuple[dict[str, Any] | None, str]:
        return await placing.placed(self._render, chat, truth.text or "", reasoning_open)

    def text_leg(self, truth: Prompt) -> Leg:
        return self._native([truth.text or ""], self._transcript.produced)

    def ids_leg(self, saw: Prompt, ids: list[int]) -> Leg:
        text = saw.text or ""
        return self._native([*(self._ids_of(text) or [text]), *ids], len(ids))

    def _native(self, prompt: list[str | int], replayed: int) -> Leg:
        pieces = self._transcript.ids is not None  # the first leg asked for them
        body = native_body(self._original, prompt, self._transcript.produced, pieces)
        usage = mapping(self._original.get("stream_options")).get("include_usage") is True
        chat = NativeToChat(self._model, include_usage=usage, replayed=replayed)
        return "/completion", body, NativeRewriter(chat, ChunkRewriter(self._transcript, "", False))
