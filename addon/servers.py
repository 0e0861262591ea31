"""What the addon knows about each upstream server, asked once through a shared client.

- Whether it echoes an assistant prefill at the start of its answer (some llama-server
  builds do): knowing keeps the splice from dropping real text that merely looks like it.
- Its context per slot (`/props`), so a continuation goes only to a server it fits on.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import httpx

from addon.continuation import token_limit
from addon.upstream import Upstream

log = logging.getLogger(__name__)
MARKER = "Zq7 "


@dataclass
class ServerInfo:
    echoes_prefill: bool | None = None
    slot_context: int | None = None


class ServerDirectory:
    def __init__(self) -> None:
        self.info: dict[Upstream, ServerInfo] = {}
        self._client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Future[None]] = set()

    def get(self, upstream: Upstream) -> ServerInfo:
        return self.info.get(upstream) or ServerInfo()

    def learn(self, upstreams: list[Upstream]) -> None:
        """Ask each server not yet known, in the background."""
        for upstream in upstreams:
            if upstream not in self.info or self.info[upstream].slot_context is None:
                task = asyncio.ensure_future(self._probe(upstream))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def client(self) -> httpx.AsyncClient:
        # One client for all: making one costs tens of milliseconds (its TLS context).
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=5)
        return self._client

    async def _probe(self, upstream: Upstream) -> None:
        info = ServerInfo()
        try:
            props = (await self.client.get(f"{upstream.url}/props")).json()
            info.slot_context = int(props["default_generation_settings"]["n_ctx"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log.info("no slot context from %s: %r", upstream.url, exc)
        info.echoes_prefill = await self._echoes(upstream)
        self.info[upstream] = info

    async def _echoes(self, upstream: Upstream) -> bool | None:
        body = {
            "messages": [
                {"role": "user", "content": "Continue."},
                {"role": "assistant", "content": MARKER},
            ],
            "max_tokens": 1,
            "temperature": 0,
            "stream": True,
        }
        text = ""
        try:
            async with self.client.stream(
                "POST", f"{upstream.url}/v1/chat/completions", json=body
            ) as response:
                if response.status_code != 200:
                    return None
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        for choice in json.loads(line[6:]).get("choices") or ():
                            text += (choice.get("delta") or {}).get("content") or ""
        except (httpx.HTTPError, ValueError) as exc:
            log.info("cannot probe %s for prefill echo: %r", upstream.url, exc)
            return None
        return text.startswith(MARKER)

    async def room_needed(self, upstream: Upstream, body: dict[str, Any], room: int) -> int | None:
        """Tokens the request takes on this server: its rendered prompt plus the tokens it
        may still write; None when the server cannot tell. When a cheap bound says it fits
        in `room`, the server is not asked (asking costs two round trips in the pause)."""
        if (bound := _upper_bound(body)) is not None and bound <= room:
            return bound
        try:
            prompt_text = body.get("prompt")
            if not isinstance(prompt_text, str):
                rendered = await self.client.post(
                    f"{upstream.url}/apply-template", json={"messages": body.get("messages", [])}
                )
                prompt_text = rendered.json()["prompt"]
            tokens = await self.client.post(
                f"{upstream.url}/tokenize", json={"content": prompt_text}
            )
            prompt = len(tokens.json()["tokens"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None
        return prompt + (token_limit(body) or 0)


TEMPLATE_TOKENS_PER_MESSAGE = 32  # role markers and separators, generously


def _upper_bound(body: dict[str, Any]) -> int | None:
    """At most this many tokens: no token holds less than one byte of text."""
    if isinstance(body.get("prompt"), str):
        return len(body["prompt"].encode()) + TEMPLATE_TOKENS_PER_MESSAGE + (token_limit(body) or 0)
    total = 0
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if content is not None and not isinstance(content, str):
            return None  # parts (images, audio): only the server can count them
        total += len((content or "").encode()) + TEMPLATE_TOKENS_PER_MESSAGE
    return total + (token_limit(body) or 0)
