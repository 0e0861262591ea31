"""What each server renders for one answer's request, and the day the model read it on.

A server's rendering of the request is asked once per answer (the messages do not change
while it streams), and again where the server was restarted since (what it runs changed).

A chat template that prints the date (`strftime_now`: Llama 3.2's "Today Date", gpt-oss,
Granite 3.3, Mistral Small 3.2) renders the same request differently on another day or
in another time zone. A continuation asked at the handoff would put the next server's
date where the model read its own: across midnight, or on a server whose clock keeps
another zone, the prompt is not what the model saw. So where the first server's template
prints the date, its rendering is asked as the answer starts, and a server of the same
template goes on from that rendering instead of its own.
"""

from __future__ import annotations

import asyncio
from typing import Any

from addon.servers.directory import ServerDirectory
from addon.servers.prompts import NotRendered
from addon.servers.upstream import Upstream


class Renderings:
    def __init__(self, servers: ServerDirectory, body: dict[str, Any]) -> None:
        self._servers = servers
        self._body = body
        self._asked: dict[tuple[str, str | None], str] = {}  # (server, what it runs) -> it
        self._dated: tuple[str, asyncio.Future[str]] | None = None  # (template, rendering)

    def keep_the_date(self, first: Upstream) -> None:
        """Ask `first` for its rendering now where its template prints the date."""
        template = self._servers.get(first).dated_template
        if template is not None and isinstance(self._body.get("messages"), list):
            asked = asyncio.ensure_future(self._servers.rendering(first, self._body))
            # Never awaited where no handoff comes: its failure is not worth a log line.
            asked.add_done_callback(lambda done: done.cancelled() or done.exception())
            self._dated = (template, asked)

    async def of(self, upstream: Upstream) -> str:
        """The request's prompt as the model would read it on `upstream`. Raises
        NotRendered."""
        info = self._servers.get(upstream)
        key = (upstream.url, info.identity)
        if key not in self._asked:
            saw = await self._as_dated(info.dated_template)
            self._asked[key] = saw or await self._servers.rendering(upstream, self._body)
        return self._asked[key]

    async def _as_dated(self, template: str | None) -> str | None:
        """The first server's rendering as the answer began, for a server whose template
        is the same one that prints the date."""
        if self._dated is None or template != self._dated[0]:
            return None
        try:
            return await self._dated[1]
        except NotRendered:
            return None
