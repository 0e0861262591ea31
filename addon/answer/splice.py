"""One streaming answer, carried across upstream legs onto one client response.

A `Splice` streams from the first server on its ladder. When told to hand off (memory
pressure, a person) or when the leg fails (connection lost, in-band error, 5xx, garbled
bytes), it drops that leg at once and asks the next server on the ladder to continue
from exactly what the client has received, rewriting that server's chunks so the client
reads one stream with one finish and one [DONE].
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from addon.answer.decide import Decision
from addon.answer.early import EarlyRefusals
from addon.answer.fleet import Fleet, Route
from addon.answer.ladder import Ladder
from addon.answer.legs import Legs
from addon.answer.notes import Notes
from addon.answer.pace import Pace
from addon.answer.resume import Resume
from addon.answer.stillreading import still_reading
from addon.formats.dialect import Dialect
from addon.formats.transcript import Transcript, stop_strings
from addon.formats.wire import ClientStream, Header, asks_to_close, forwardable
from addon.handoff.exact import first_leg_asks
from addon.handoff.nextleg import NextLeg
from addon.handoff.record import Handoff
from addon.servers.exchange import Exchange
from addon.servers.upstream import Upstream

BACK_FROM = {"pressure", "slow", "route"}  # why an answer left the primary: hand back undoes
PROOF_WAIT_S = 20.0  # the most a cut answer waits for its servers' proofs under way
log = logging.getLogger(__name__)


class Splice:
    def __init__(
        self,
        *,
        path: str,
        dialect: Dialect,
        headers: Sequence[Header],
        body: dict[str, Any],
        raw_body: bytes,
        route: Route,
        fleet: Fleet,
        answer: str = "",
        on_handoff: Callable[[Handoff], None] = lambda _: None,
        on_exchange: Callable[[Exchange], None] | None = None,  # None: legs are not kept
    ) -> None:
        """The client's request (`path` to `body`, `raw_body` as sent), where it may go
        (`route`), what it may ask of the servers (`fleet`), and its name there (`answer`,
        the flow's id: its shadow's key)."""
        self.path = path
        self.dialect = dialect
        # post() sets these itself for each upstream.
        self.headers = [
            (k, v)
            for k, v in forwardable(headers)
            if k.lower() not in (b"host", b"accept-encoding")
        ]
        if asks_to_close(headers):
            self.headers.append((b"connection", b"close"))
        self._fleet = fleet
        self._answer = answer
        self.body = body
        self.ladder = list(route.ladder)
        servers = fleet.servers
        # Token-exact replay needs the first leg's token ids (see handoff/exact.py).
        self.asks_ids, strip_pieces, self.raw_body = first_leg_asks(
            path, body, raw_body, self.ladder, servers if fleet.exact else None
        )
        self.transcript = Transcript(stops=stop_strings(body))
        self.handoffs: list[Handoff] = []
        self.streaming = dialect.streaming(body)
        self.client: ClientStream | None = None  # where it writes, once it runs
        self._next = NextLeg(path, dialect, body, self.transcript, servers, self.asks_ids)
        self._on_handoff = on_handoff
        self.primary = route.primary
        self._locked = route.locked
        self._rungs = Ladder(self.ladder, fleet.state, self._admits)
        self._leg_task: asyncio.Future[str | None] | None = None
        self._moving = False  # a handoff is being checked or carried out
        self._pending: tuple[str, str, float, int | None] | None = None  # why, kind, when, where
        self._cancelled = False
        self._early = EarlyRefusals(fleet, self.ladder, self._rungs)
        self._legs = Legs(
            path=path, dialect=dialect, body=body, raw_body=self.raw_body, headers=self.headers,
            streaming=self.streaming, strip_pieces=strip_pieces, primary=self.primary,
            fleet=fleet, transcript=self.transcript, handoffs=self.handoffs, early=self._early,
            resume=Resume(fleet, self._next, answer, self.primary, self._admits),
            notes=Notes(dialect, route.note), may_move=self._may_move,
            handing_off=lambda: self._pending is not None, on_handoff=on_handoff,
            on_exchange=on_exchange,
        )  # fmt: skip
        spaced = lambda: self._spaced  # noqa: E731
        self._decision = Decision(self._next, self.ladder, self._admits, spaced, fleet, answer)

    def _admits(self, server: Upstream) -> bool:
        """Whether the answer may go on on `server` now: the client may be served there
        (see servers/credentials.py), and once text has gone out as a turn to continue,
        the server is proven to continue one (another would start a new answer)."""
        fleet = self._fleet
        if not fleet.credentials.admits(
            server.url, self.primary.url, self._locked, self._legs.accepted
        ):
            return False
        if not self.dialect.continues_a_turn(self.body):
            return True
        delivered = self.transcript.content or self.transcript.reasoning
        return not delivered or fleet.continues(server, self.dialect.name, self._spaced)

    @property
    def _spaced(self) -> bool:
        """Whether the answer so far ends in whitespace (which a trimming template drops)."""
        content = self.transcript.content
        return bool(content) and content[-1][-1:].isspace()

    @property
    def current(self) -> Upstream:
        return self._rungs.current

    @property
    def next_leg(self) -> NextLeg:
        return self._next

    def next_server(self) -> Upstream | None:
        """Where an asked-for handoff would go first now, if anywhere."""
        below = self._rungs.below()
        return self.ladder[below[0]] if below and self.can_cut else None

    def handoff(
        self, reason: str, kind: str = "requested", targets: list[int] | None = None
    ) -> asyncio.Future[bool] | None:
        """Ask to move the answer to the first of `targets` (default: the servers below)
        that may go on with it and has room (answer/decide.py). None with nothing to move
        (complete, moving, all its tokens) or nowhere it may go (it stays, saying why);
        else a future that says whether it moved, cut at once where nothing is asked."""
        if not self.can_cut or self._moving or self._decision.quiet(kind):
            return None
        if self._spent() is not None:
            return None
        decided = time.monotonic()
        passed = self._decision.known(self._rungs.below() if targets is None else targets)
        if not passed:
            self._decision.declined(kind, self.current.url)
            return None
        if self._decision.at_once(passed[0]):
            self._cut(reason, kind, decided, passed[0])  # at once: nothing to ask
            moved = asyncio.get_running_loop().create_future()
            moved.set_result(True)
            return moved
        self._moving = True
        return asyncio.ensure_future(self._move(reason, kind, decided, passed))

    def hand_back(self, min_left: int) -> asyncio.Future[bool] | None:
        """Move the answer back to the primary (whose state the caller has checked),
        unless fewer than `min_left` tokens are still to come."""
        home, rungs = self.ladder.index(self.primary), self._rungs
        if rungs.at == home or home in rungs.failed:
            return None
        # Only what pressure did (or a start elsewhere) is undone: not a person's request.
        left = [h.kind for h in self.handoffs if h.source == self.primary.url]
        if (left[-1] if left else "route") not in BACK_FROM:
            return None
        limit = self.dialect.limit(self.body)
        if limit is not None and limit - self.transcript.produced < min_left:
            return None
        return self.handoff(f"{self.primary.url} is clear again", "handback", [home])

    async def _move(self, reason: str, kind: str, decided: float, targets: list[int]) -> bool:
        """Ask the `targets` whether they may go on and have room, while the leg goes on."""
        leg = self._leg_task
        try:
            target = await self._decision.asked(targets)
            if leg is not self._leg_task or not self.can_cut or self._spent() is not None:
                return False  # the answer ended, moved or wrote its last token meanwhile
            if target is None:
                self._decision.declined(kind, self.current.url)
                return False
            self._cut(reason, kind, decided, target)
            return True
        finally:
            if self._pending is None:
                self._moving = False

    def _spent(self) -> str | None:
        """Why nothing is left to continue: the answer has every token its request allows
        (a leg asked to go on would still write one: no server takes a limit of 0)."""
        limit = self.dialect.limit(self.body)
        if limit is None or self.transcript.produced < limit:
            return None
        return f"the answer has all the {limit} tokens its request allows"

    @property
    def moving(self) -> bool:
        """Whether a handoff is being decided or made."""
        return self._moving

    @property
    def can_cut(self) -> bool:
        leg = self._leg_task
        return leg is not None and not leg.done() and not self._legs.finishing and not self._pending

    def _cut(self, reason: str, kind: str, decided: float, target: int | None) -> None:
        """Drop the current leg now; `run` goes on at `target` (None: as after a failure)."""
        assert self._leg_task is not None
        self._pending = (reason, kind, decided, target)
        self._leg_task.cancel()

    @property
    def heard(self) -> float:
        """When bytes last came from its current server (time.monotonic()); 0.0 before
        any came, or where the leg's pace is not kept."""
        pace = self._legs.pace
        return pace.heard if pace is not None else 0.0

    def check_pace(self, now: float) -> None:
        """Leave a leg that stalled (like a failed one) or slowed far below its own pace
        (like an asked-for handoff: it stays if no other server has room); end one that
        stalled after the answer's end as its server would have ended it."""
        legs = self._legs
        pace = legs.pace
        if pace is None or pace.asking is not None:
            return
        if legs.finishing and legs.pump is not None:
            verdict = pace.verdict(now)
            if verdict is not None and verdict[0] == "stalled" and legs.pump.end_now():
                legs.pace = None
                said = verdict[1]
                log.info("%s sent the answer's end, then %s: ended there", self.current.url, said)
            return
        if not self.can_cut or (verdict := pace.verdict(now)) is None:
            return
        kind, why = verdict
        if kind == "slow":
            self.handoff(f"{self.current.url}: {why}", kind)
        elif kind == "silent":  # unless it is still at work
            pace.asking = asyncio.ensure_future(self._unless_reading(pace, why))
        else:
            self._leave_stalled(why, now)

    async def _unless_reading(self, pace: Pace, why: str) -> None:
        """Leave a server silent past its wait, unless it says it is still at work."""
        upstream = self.current
        reading = await still_reading(upstream.url, self._fleet.question_headers(upstream.url))
        pace.asking = None
        if pace is not self._legs.pace or pace.first is not None or not self.can_cut:
            return
        if reading is not None:
            log.info("%s is still at work (%s): waiting as long again", upstream.url, reading)
            pace.stretch(time.monotonic())
        else:
            self._leave_stalled(why, time.monotonic())

    def _leave_stalled(self, why: str, now: float) -> None:
        self._legs.pace = None
        self._fleet.mark_down(self.current, why)
        self._cut(f"{self.current.url}: {why}", "stalled", now, None)

    def cancel(self) -> None:
        """The client went away: drop every leg."""
        self._cancelled = True
        if self._leg_task is not None:
            self._leg_task.cancel()

    async def run(self, client: ClientStream) -> None:
        self.client = client
        renderings = self._next.renderings
        if self.streaming and len(self.ladder) > 1 and renderings and self.dialect.name == "chat":
            renderings.keep_the_date(self.current)
        while True:
            self._leg_task = asyncio.ensure_future(self._legs.stream(client, self.current))
            try:
                failure = await self._leg_task
                kind, decided, target = "failure", time.monotonic(), None
            except asyncio.CancelledError:
                if self._cancelled or self._pending is None:
                    raise
                failure, kind, decided, target = self._pending
            finally:
                self._pending = None
                self._moving = False
            if failure is None:
                return
            if kind == "failure" and await self._early.ask_again_here(self.current, client.started):
                continue
            if (
                kind == "failure"
                and (wait := self._early.wait_for_primary(self.current, client.started)) is not None
            ):
                log.info("%s is asked again in %.2f s, as it asked", self.current.url, wait)
                await asyncio.sleep(wait)
                self._rungs.failed.discard(self._rungs.at)
                continue
            if target is None:
                target = await self._after_failure()
            if target is None and (wait := self._early.retry_soon(client.started)) is not None:
                log.info("%s is asked again in %.2f s (it asked to wait)", self.current.url, wait)
                await asyncio.sleep(wait)
                self._rungs.failed.discard(self._rungs.at)
                continue
            why = self._spent() or self.dialect.cannot_continue(self.body, self.transcript)
            if why is not None:
                self._give_up(client, f"{failure}; {why}")
                return
            if target is None:
                unproven = self._fleet.unproven(
                    self.ladder, self._admits, self.dialect.name, self._spaced
                )
                self._give_up(client, failure + unproven)
                return
            self._announce(failure, kind, decided, target)

    async def _after_failure(self) -> int | None:
        """Where the answer goes now that its server failed it. An unproven server cannot
        go on with it: one whose proof is under way (a cut soon after start) is waited for."""
        target = self._rungs.after_failure()
        if target is None and await self._fleet.servers.learnt(self._rungs.left(), PROOF_WAIT_S):
            target = self._rungs.would_go()
        return target

    def _announce(self, reason: str, kind: str, decided: float, target: int) -> None:
        source = self.current
        self._rungs.at = target
        handoff = Handoff(
            reason=reason,
            source=source.url,
            target=self.current.url,
            at_token=self.transcript.produced,
            at_char=len(self.transcript.text),
            decided=decided,
            kind=kind,
            passed_by=self._decision.passed_by(target),
        )
        self.handoffs.append(handoff)
        self._fleet.shadows.handed_off(self._answer)
        self._on_handoff(handoff)

    def _give_up(self, client: ClientStream, failure: str) -> None:
        message = f"no server could continue this answer: {failure}"
        delivered = f" after {self.transcript.produced} tokens" if client.started else ""
        log.warning("an answer to %s ended%s: %s", self.primary.url, delivered, message)
        if client.started:
            client.end(self.dialect.error_end(message))
        elif (refusal := self._early.first_refusal) is not None:
            client.respond(*refusal)  # the primary's own error
        else:
            client.respond(502, *self.dialect.refusal(message))

    def _may_move(self) -> bool:
        """Whether another server could go on with the answer if this leg failed now."""
        if self.dialect.cannot_continue(self.body, self.transcript) is not None:
            return False
        return self._rungs.would_go() is not None
