"""What each server renders for one answer's request, and the day the model read it on.

A server's rendering of the request is asked once per answer (the messages do not change
while it streams), and again where the server was restarted since (what it runs changed).

A chat template that prints the date (`strftime_now`: Llama 3.2's "Today Date", gpt-oss,
Granite 3.3, Mistral Small 3.2) renders the same request differently on another day or
in another time zone. A continuation asked at the handoff would put the next server's
date where the model read its own: across midnight, or on a server whose clock keeps
another zone, the prompt is not what the model saw. So where the first server's template
prints the date, its rendering is asked as the answer starts (a llama-server's text, a
vLLM's ids as text), and a server of the same template goes on from that rendering
instead of its own (a vLLM from its ids of that text). Where that rendering could not be
had, the date the model read is not known: such a server is refused, saying so, rather
than let it print its own.

A rendering sent to a llama-server again and again (a shadow's updates, then the
continuation) is read there as text each time: the server tokenizes the whole prompt for
every request, in the pause too. Its own ids of it are then asked once, beside the answer,
and sent in the text's place: the same tokens, as its /completion makes them of the text
(checked against its own count of that text, from a request it read).
"""

from __future__ import annotations

import asyncio
from typing import Any

from addon.handoff import vllm
from addon.servers.directory import ServerDirectory
from addon.servers.engines import LLAMA_SERVER
from addon.servers.prompts import Counted, NotRendered
from addon.servers.upstream import Upstream


class Renderings:
    def __init__(self, servers: ServerDirectory, body: dict[str, Any], counted: Counted) -> None:
        """`counted`: the answer's token counts of texts, as servers read them."""
        self._servers = servers
        self._body = body
        self._counted = counted
        self._asked: dict[tuple[str, str | None], str] = {}  # (server, what it runs) -> it
        # A server's own ids of its rendering, where they were asked: (what it runs, the
        # text, its ids).
        self._ids: dict[str, asyncio.Future[tuple[str | None, str, list[int]]]] = {}
        # The first server's template and its rendering as the answer began.
        self._dated: tuple[Upstream, str, asyncio.Future[str]] | None = None

    def keep_the_date(self, first: Upstream) -> None:
        """Ask `first` for its rendering now where its template prints the date."""
        template = self._servers.get(first).dated_template
        if template is not None and isinstance(self._body.get("messages"), list):
            asked = asyncio.ensure_future(self._rendering(first))
            # Never awaited where no handoff comes: its failure is not worth a log line.
            asked.add_done_callback(lambda done: done.cancelled() or done.exception())
            self._dated = (first, template, asked)

    async def of(self, upstream: Upstream) -> str:
        """The request's prompt as the model would read it on `upstream` (a llama-server).
        Raises NotRendered."""
        info = self._servers.get(upstream)
        key = (upstream.url, info.identity)
        if key not in self._asked:
            saw = await self.dated(upstream)
            self._asked[key] = saw or await self._servers.rendering(upstream, self._body)
        return self._asked[key]

    def ask_ids(self, upstream: Upstream) -> None:
        """`upstream` (a llama-server) is sent its rendering again and again: its own
        token ids of it are asked once, beside the answer (`ids_of`)."""
        if upstream.url in self._ids or self._servers.get(upstream).engine != LLAMA_SERVER:
            return
        asked = asyncio.ensure_future(self._tokenized(upstream))
        # Never awaited: a failure leaves the text in use.
        asked.add_done_callback(lambda done: done.cancelled() or done.exception())
        self._ids[upstream.url] = asked

    def ids_of(self, upstream: Upstream, text: str) -> list[int] | None:
        """`upstream`'s own ids of its rendering `text`, where they have been had already
        (never waited for), it still runs what it ran then, and they are as many as the
        tokens it read of that text in a request (a build whose /tokenize reads a text
        another way than its /completion is never trusted); None otherwise."""
        asked = self._ids.get(upstream.url)
        if asked is None or not asked.done() or asked.cancelled() or asked.exception():
            return None
        identity, tokenized, ids = asked.result()
        if identity != self._servers.get(upstream).identity or tokenized != text:
            return None
        read = self._servers.kept_count(self._counted, upstream, text)
        return ids if read == len(ids) else None

    async def _tokenized(self, upstream: Upstream) -> tuple[str | None, str, list[int]]:
        identity = self._servers.get(upstream).identity
        text = await self.of(upstream)
        return identity, text, await self._servers.prompt_ids(upstream, text)

    async def dated(self, upstream: Upstream) -> str | None:
        """The first server's rendering as the answer began, for `upstream` whose template
        is the same one, which prints the date (None: it is not). Raises NotRendered where
        that rendering could not be had: `upstream` would print its own date, which need
        not be the one the model read."""
        if self._dated is None or self._servers.get(upstream).dated_template != self._dated[1]:
            return None
        first, _, asked = self._dated
        try:
            if asked.cancelled():
                raise NotRendered("it was not asked to the end")
            return await asked
        except NotRendered as why:
            raise NotRendered(
                f"{first.url}'s chat template prints the date, and its rendering as the answer "
                f"began could not be had ({why}): the date the model read is not known, and "
                f"{upstream.url} would print its own"
            ) from None

    async def _rendering(self, server: Upstream) -> str:
        """`server`'s rendering of the request, as text. Raises NotRendered."""
        servers = self._servers
        if servers.get(server).engine != vllm.ENGINE:
            return await servers.rendering(server, self._body)
        model = servers.own_model(server, self._body.get("model")) or self._body.get("model")
        return await vllm.rendered_text(servers.asker(server), server.url, model, self._body)
