"""What a continuation on a server needs before its request goes out: the server still
admitted (asked again now, in case it changed since it was proven), the answer's state
carried there where that should be done (a shadow's prefill, or a KV migration), and
the request itself.

Where a shadow's slot holds the answer, the pause is what is left: the recheck, and a
decode step or two on the server. The request then goes out while the recheck still
runs, built from what was known of the server, and none of its answer reaches the client
until the recheck says the server is what it was built for (`Prepared.unchecked`); where
it is not, that leg is dropped unread and the continuation is built again after the
recheck, as anywhere else."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from addon.answer.fleet import Fleet
from addon.formats.dialect import Rewriter
from addon.handoff.nextleg import NextLeg
from addon.handoff.record import Handoff
from addon.servers.upstream import Upstream

log = logging.getLogger(__name__)


AGAIN = "the server changed while its continuation went out: built again"


@dataclass(frozen=True)
class Prepared:
    # Path, body and how to rewrite its chunks; or why there is no continuation there.
    request: tuple[str, bytes, Rewriter] | str
    restored: int | None = None  # a migration's slot there that holds the answer
    # A recheck still running as the request goes out: None where the server is what
    # the request was built for, else AGAIN. Awaited before the leg's answer is read.
    unchecked: asyncio.Future[str | None] | None = None


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
        # What a recheck beside a leg it dropped said, for that handoff and server: the
        # leg built again at once does not wait for the same questions again (a server
        # that hangs on them: 5 s).
        self._rechecked: tuple[Handoff, Upstream, str | None] | None = None

    async def prepare(self, upstream: Upstream, handoff: Handoff, at_once: bool = True) -> Prepared:
        """The continuation `handoff` asks of `upstream`, or why there is none. A slot
        it names in `restored` is `release`d by the caller once the leg has ended; a
        recheck in `unchecked` is cancelled by the caller once the leg has ended.
        `at_once`: the request may go out while the recheck runs (see above)."""
        servers = self._fleet.servers
        trusted = upstream not in servers.unverified
        generate = upstream != self._primary  # a primary is asked nothing that generates
        # The server is asked whether it changed while a shadow update in flight there
        # ends: each is a wait in the pause, and neither needs the other's answer. What
        # changed is learnt again here, not by the recheck: a request sent beside it may
        # hold the server's only slot, which learning asks for.
        rechecked, self._rechecked = self._rechecked, None
        if rechecked is not None and rechecked[0] is handoff and rechecked[1] == upstream:
            recheck = asyncio.ensure_future(_said(rechecked[2]))
        else:
            recheck = asyncio.ensure_future(servers.recheck(upstream, generate, learn=False))
        unchecked = None  # (set: the recheck is the caller's)
        try:
            shadowed = await self._fleet.shadows.settled(self._answer, upstream)
            if shadowed and at_once:
                built = await self._built(upstream, handoff, migrate=False)
                confirmed = self._confirmed(handoff, upstream, recheck, trusted)
                unchecked = asyncio.ensure_future(confirmed)
                return replace(built, unchecked=unchecked)
            changed = await recheck
        finally:
            if unchecked is None:  # (done: a no-op; the leg cancelled meanwhile: asks no more)
                recheck.cancel()
        if changed is not None:
            await servers.learn_again(upstream, generate, changed)
            if (refused := self._refusal(upstream, changed)) is not None:
                return Prepared(refused)
        return await self._built(upstream, handoff, migrate=not shadowed)

    async def _built(self, upstream: Upstream, handoff: Handoff, migrate: bool) -> Prepared:
        restored = None
        try:
            restored = await self._migrated(upstream, handoff) if migrate else None
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

    def _refusal(self, upstream: Upstream, changed: str) -> str | None:
        """Why `upstream` may no longer take this continuation: it `changed` since it was
        proven (learnt again since) and is no longer admitted."""
        if self._admits(upstream):
            return None  # learnt again, and it still continues: the leg uses what is known now
        return f"{upstream.url}: {changed}: {self._fleet.servers.get(upstream).continues_why}"

    async def _confirmed(
        self, handoff: Handoff, upstream: Upstream, recheck: asyncio.Future[str | None],
        trusted: bool,
    ) -> str | None:  # fmt: skip
        """None where the recheck says `upstream` runs what a request built before it
        was built for (nothing changed, and its tokenizer is as trusted as it was); else
        AGAIN."""
        try:
            changed = await recheck
        finally:
            recheck.cancel()
        if changed is None and trusted == (upstream not in self._fleet.servers.unverified):
            return None
        self._rechecked = (handoff, upstream, changed)
        return AGAIN

    async def _migrated(self, upstream: Upstream, handoff: Handoff) -> int | None:
        """Where no shadow's slot holds the answer, its KV state moved to `upstream` when a
        migration should: the slot it is in."""
        if (migrator := self._fleet.migrating) is None:
            return None
        return await migrator.for_handoff(self._next, self._fleet.servers, upstream, handoff)


async def _said(changed: str | None) -> str | None:
    """A recheck's word, had already."""
    return changed
