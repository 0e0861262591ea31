"""What the model saw on the day it saw it.

A chat template that prints the date (`strftime_now`: Llama 3.2's "Today Date", gpt-oss,
Granite 3.3, Mistral Small 3.2) renders the same request differently on another day or
in another time zone. A continuation asked at the handoff would put the next server's
date where the model read its own: across midnight, or on a server whose clock keeps
another zone, the prompt is not what the model saw. So where the primary's template
prints the date, its rendering is asked as the answer starts, and a server of the same
template goes on from that rendering instead of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from addon.servers.prompts import NotRendered


class DatedRendering:
    """The primary's rendering of the request, asked as the answer starts."""

    def __init__(self, template: str, rendering: Awaitable[str]) -> None:
        self.template = template
        self._asked: asyncio.Future[str] = asyncio.ensure_future(rendering)
        # Never asked for when no handoff comes: its failure is not worth a log line.
        self._asked.add_done_callback(lambda done: done.cancelled() or done.exception())

    async def for_template(self, template: str | None) -> str | None:
        """The rendering the model saw, for a server whose template is `template` (None
        where it is another, or the primary could not render)."""
        if template != self.template:
            return None
        try:
            return await self._asked
        except NotRendered:
            return None
