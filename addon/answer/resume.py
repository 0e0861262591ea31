"""What a continuation on a server needs before its request goes out: the server still
admitted (asked again now, in case it changed since it was proven), the answer's state
carried there where that should be done (a shadow's prefill, or a KV migration), and
the request itself."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from addon.answer.fleet import Fleet
from addon.formats.dialect import Rewriter
from addon.handoff.nextleg import NextLeg
from addon.handoff.record import Handoff
from addon.servers.upstream import Upstream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prepared:
    # Path, body and how to rewrite its chunks; or why there is no continuation there.
    request: tuple[str, bytes, Rewriter] | str
    restored: int | None = None  # a migration's slot there that holds the answer


class Resume:
    def __init__(
        self,
        fleet: Fleet,
        next_leg: NextLeg,
        answer: str,
        primary: Upstream,
        admits: Callable[[Upstream], bool],
    ) -> None:
        self._fleet = fleet
        self._next = next_leg
        self._answer = answer  # the flow's id: its shadow's key
        self._primary = primary
        self._admits = admits

    async def prepare(self, upstream: Upstream, handoff: Handoff) -> Prepared:
        """The continuation `handoff` asks of `upstream`, or why there is none. A slot
        it names in `restored` is `release`d by the caller once the leg has ended."""
        # The server is asked whether it changed while a shadow update in flight there
        # ends: each is a wait in the pause, and neither needs the other's answer.
        recheck = asyncio.ensure_future(self._changed(upstream))
        try:
            shadowed = await self._fleet.shadows.settled(self._answer, upstream)
            changed = await recheck
        finally:
            recheck.cancel()  # (done: a no-op; the leg cancelled meanwhile: asks no more)
        if changed is not None:
            return Prepared(changed)
        restored = None
        try:
            restored = None if shadowed else await self._migrated(upstream, handoff)
            judge = self._judge(upstream, handoff) if restored is not None else None
            request = await self._next.request(upstream, handoff, restored is not None, judge)
        except Exception as exc:  # one answer's odd shape must not end it unexplained
            log.exception("cannot build the continuation for %s", upstream.url)
            request = f"cannot build a continuation for {upstream.url}: {exc!r}"
        return Prepared(request, restored)

    def release(self, upstream: Upstream, restored: int) -> None:
        """Once its continuation has been answered, the slot is free for other migrations."""
        self._fleet.migrator.release(upstream.url, restored)

    def _judge(self, upstream: Upstream, handoff: Handoff) -> Callable[[dict[str, Any]], None]:
        """What says, from the continuation's first timings, what a restore saved."""
        moved = handoff.migration
        assert moved is not None
        return lambda timings: self._fleet.migrator.judge(upstream.url, moved, timings)

    async def _changed(self, upstream: Upstream) -> str | None:
        """Why `upstream` may no longer take this continuation: it changed since it was
        proven (asked now, and learnt again where it did) and is no longer admitted."""
        generate = upstream != self._primary  # a primary is asked nothing that generates
        if (changed := await self._fleet.servers.recheck(upstream, generate)) is None:
            return None
        if self._admits(upstream):
            return None  # learnt again, and it still continues: the leg uses what is known now
        return f"{upstream.url}: {changed}: {self._fleet.servers.get(upstream).continues_why}"

    async def _migrated(self, upstream: Upstream, handoff: Handoff) -> int | None:
        """Where no shadow's slot holds the answer, its KV state moved to `upstream` when a
        migration should: the slot it is in."""
        if (migrator := self._fleet.migrating) is None:
            return None
        return await migrator.for_handoff(self._next, self._fleet.servers, upstream, handoff)
