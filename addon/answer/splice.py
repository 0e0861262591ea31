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
from addon.answer.notes import Notes
from addon.answer.pace import Pace
from addon.answer.pump import Pump
from addon.answer.resume import Resume
from addon.answer.stillreading import still_reading
from addon.formats.dialect import Adapter, Dialect, Rewriter
from addon.formats.transcript import Transcript, stop_strings
from addon.formats.wire import ClientStream, Header, asks_to_close, forwardable
from addon.handoff.exact import first_leg_asks
from addon.handoff.nextleg import NextLeg, rerouted
from addon.handoff.record import Handoff
from addon.handoff.seen import prefill_echoed
from addon.servers.credentials import redacted
from addon.servers.engines import RENDERS_ON_ASKING
from addon.servers.exchange import Exchange
from addon.servers.upstream import Upstream, UpstreamError, post, sent_headers

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
        self._accepted = False  # the primary has answered: the client is one it lets in
        self.body = body
        self.ladder = list(route.ladder)
        servers = fleet.servers
        # Token-exact replay needs the first leg's token ids (see handoff/exact.py).
        self.asks_ids, self._strip_pieces, self.raw_body = first_leg_asks(
            path, body, raw_body, self.ladder, servers if fleet.exact else None
        )
        self.transcript = Transcript(stops=stop_strings(body))
        self.handoffs: list[Handoff] = []
        self.streaming = dialect.streaming(body)
        self._next = NextLeg(path, dialect, body, self.transcript, servers, self.asks_ids)
        self._on_handoff = on_handoff
        self._on_exchange = on_exchange
        self.primary = route.primary
        self._locked = route.locked
        self._rungs = Ladder(self.ladder, fleet.state, self._admits)
        self._leg_task: asyncio.Future[str | None] | None = None
        self._moving = False  # a handoff is being checked or carried out
        self._pending: tuple[str, str, float, int | None] | None = None  # why, kind, when, where
        self._finishing = False
        self._pump: Pump | None = None  # the leg's pump while it is pushed
        self._cancelled = False
        self._notes = Notes(dialect, route.note)
        self._tell_at_first_byte = False  # a migrated leg's note waits for its first token
        self._limits = fleet.pace
        self._pace: Pace | None = None  # the current leg's
        self._early = EarlyRefusals(fleet, self.ladder, self._rungs)
        self._resume = Resume(fleet, self._next, answer, self.primary, self._admits)
        spaced = lambda: self._spaced  # noqa: E731
        self._decision = Decision(self._next, self.ladder, self._admits, spaced, fleet, answer)

    def _admits(self, server: Upstream) -> bool:
        """Whether the answer may go on on `server` now: the client may be served there
        (see servers/credentials.py), and once text has gone out as a turn to continue,
        the server is proven to continue one (another would start a new answer)."""
        fleet = self._fleet
        if not fleet.credentials.admits(server.url, self.primary.url, self._locked, self._accepted):
            return False
        if not self.dialect.continues_a_turn(self.body):
            return True
        self.transcript.settle()
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
        self.transcript.settle()
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
    def can_cut(self) -> bool:
        leg = self._leg_task
        return leg is not None and not leg.done() and not self._finishing and not self._pending

    def _cut(self, reason: str, kind: str, decided: float, target: int | None) -> None:
        """Drop the current leg now; `run` goes on at `target` (None: as after a failure)."""
        assert self._leg_task is not None
        self._pending = (reason, kind, decided, target)
        self._leg_task.cancel()

    def check_pace(self, now: float) -> None:
        """Leave a leg that stalled (like a failed one) or slowed far below its own pace
        (like an asked-for handoff: it stays if no other server has room); end one that
        stalled after the answer's end as its server would have ended it."""
        pace = self._pace
        if pace is None or pace.asking is not None:
            return
        if self._finishing and self._pump is not None:
            verdict = pace.verdict(now)
            if verdict is not None and verdict[0] == "stalled" and self._pump.end_now():
                self._pace = None
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
        if pace is not self._pace or pace.first is not None or not self.can_cut:
            return
        if reading is not None:
            log.info("%s is still at work (%s): waiting as long again", upstream.url, reading)
            pace.stretch(time.monotonic())
        else:
            self._leave_stalled(why, time.monotonic())

    def _leave_stalled(self, why: str, now: float) -> None:
        self._pace = None
        self._fleet.mark_down(self.current, why)
        self._cut(f"{self.current.url}: {why}", "stalled", now, None)

    def cancel(self) -> None:
        """The client went away: drop every leg."""
        self._cancelled = True
        if self._leg_task is not None:
            self._leg_task.cancel()

    async def run(self, client: ClientStream) -> None:
        renderings = self._next.renderings
        if self.streaming and len(self.ladder) > 1 and renderings and self.dialect.name == "chat":
            renderings.keep_the_date(self.current)
        while True:
            self._leg_task = asyncio.ensure_future(self._leg(client))
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
            self.transcript.settle()
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

    async def _leg(self, client: ClientStream) -> str | None:
        """Stream one leg into the client. None when the answer is complete, otherwise
        why the leg failed."""
        upstream = self.current
        self._early.new_leg()
        self._pace = Pace(time.monotonic(), self._limits) if self._limits.enabled() else None
        restored: int | None = None  # a migration's slot on `upstream` that holds the answer
        try:
            if not self.handoffs:
                body = self.raw_body
                if upstream != self.primary:
                    own = self._fleet.servers.own_model(upstream, self.body.get("model"))
                    body = rerouted(self.body, body, own)
                path, rewriter = self.path, None
            else:
                prepared = await self._resume.prepare(upstream, self.handoffs[-1])
                request, restored = prepared.request, prepared.restored
                if isinstance(request, str) or restored is None:
                    self._notes.tell(client, self.handoffs)
                else:
                    # What the restore saved is known at its first token: told with it.
                    self._tell_at_first_byte = True
                if isinstance(request, str):
                    return request
                path, body, rewriter = request
            return await self._stream_leg(client, upstream, path, body, rewriter)
        finally:
            if self._tell_at_first_byte:  # the leg ended before its first byte
                self._tell_at_first_byte = False
                self._notes.tell(client, self.handoffs)
            if restored is not None:
                self._resume.release(upstream, restored)

    async def _stream_leg(
        self, client: ClientStream, upstream: Upstream, path: str, body: bytes,
        rewriter: Rewriter | None,
    ) -> str | None:  # fmt: skip
        headers = self._fleet.credentials.leg_headers(
            upstream.url, self.headers, upstream == self.primary, self._accepted
        )
        exchange = Exchange(
            upstream.url, "POST", path, redacted(sent_headers(upstream, body, headers)), body,
            purpose="leg", leg=len(self.handoffs),
        )  # fmt: skip
        try:
            failure = await self._exchange(
                client, upstream, path, body, headers, rewriter, exchange
            )
        except asyncio.CancelledError:
            exchange.end("handed off" if self._pending is not None else "cancelled")
            raise
        else:
            exchange.end("complete" if failure is None else "failed", failure)
        finally:
            if self._on_exchange is not None:
                self._on_exchange(exchange)
        return failure

    async def _exchange(
        self, client: ClientStream, upstream: Upstream, path: str, body: bytes,
        headers: list[Header], rewriter: Rewriter | None, exchange: Exchange,
    ) -> str | None:  # fmt: skip
        if self._pace is not None:
            read_ms = self._fleet.migrator.rates.read_ms.get(upstream.url)
            firsts = self._fleet.first_events
            self._pace.first_token_s = self._limits.first_token_deadline(
                len(body), read_ms, firsts.of(upstream.url)
            )
            self._pace.on_first = lambda seconds: firsts.saw(upstream.url, len(body), seconds)
        try:
            response = await post(upstream, path, body, headers)
        except UpstreamError as exc:
            self._fleet.mark_down(upstream, str(exc))
            return str(exc)
        exchange.respond(response.status, response.headers)
        if self._pace is not None:
            self._pace.saw(time.monotonic())
        if upstream == self.primary and 200 <= response.status < 300:
            self._accepted = True
        if self._on_exchange is not None:
            response.tap = exchange.keep
        try:
            if response.status != 200:
                return await self._early.refused(
                    response, upstream, path, client, self.primary, not self.handoffs
                )
            if not self.streaming:
                answer = await response.read_all()
                notes = self._notes.headers(self.handoffs)
                client.respond(200, [*response.headers, *notes], answer, response.reason)
                return None
            if not client.started:
                client.start(200, list(response.headers), response.reason)
            self._notes.release(client)
            info = self._fleet.servers.get(upstream)
            raw_pieces = info.engine in RENDERS_ON_ASKING
            echoes = prefill_echoed(self.body, info)  # where it writes the answer's first text
            self.transcript.begin_leg(upstream.url, info.tokenizer, raw_pieces, echoes)
            strip = self._strip_pieces
            reader = self.dialect.reader(self.transcript, rewriter, strip, upstream.url)
            pump = Pump(
                client, self.transcript, reader, self._pace,
                flush=lambda out: self._flush(client, out), finishing=self._mark_finishing,
                may_move=self._may_move,
            )  # fmt: skip
            if isinstance(rewriter, Adapter):
                failure = await pump.run(rewriter.adapt(response.body()), upstream.url)
            else:
                self._pump = pump
                failure = await pump.run_pushed(response, upstream.url)
            if failure is not None and pump.closed:
                self._fleet.mark_down(upstream, "closed the stream mid-answer")
            return failure
        except UpstreamError as exc:
            self._fleet.mark_down(upstream, str(exc))
            return str(exc)
        finally:
            self._pump = None
            response.close()

    def _may_move(self) -> bool:
        """Whether another server could go on with the answer if this leg failed now."""
        self.transcript.settle()
        if self.dialect.cannot_continue(self.body, self.transcript) is not None:
            return False
        return self._rungs.would_go() is not None

    def _mark_finishing(self) -> None:
        self._finishing = True

    def _flush(self, client: ClientStream, out: list[bytes]) -> None:
        if not out:
            return
        if self._tell_at_first_byte:
            self._tell_at_first_byte = False
            self._notes.tell(client, self.handoffs)
        client.write(b"".join(out))
        if self.handoffs and self.handoffs[-1].pause_ms is None:
            handoff = self.handoffs[-1]
            handoff.pause_ms = (time.monotonic() - handoff.decided) * 1000
            self._on_handoff(handoff)
            log.info("%s %s", handoff.kind, handoff.describe())
