"""The legs of one spliced answer, each streamed from its server into the one client
response: the first as the client asked it, each later one as the answer's continuation
there (answer/resume.py), with what the client is told of the move (answer/notes.py).
Where the answer goes next, and when, is the splice's to say (answer/splice.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from addon.answer.early import EarlyRefusals
from addon.answer.fleet import Fleet
from addon.answer.notes import Notes
from addon.answer.pace import Pace
from addon.answer.pump import Pump
from addon.answer.resume import AGAIN, Resume
from addon.formats.dialect import Adapter, Dialect, Rewriter
from addon.formats.transcript import Transcript
from addon.formats.wire import ClientStream, Header
from addon.handoff.nextleg import rerouted
from addon.handoff.record import Handoff
from addon.handoff.seen import prefill_echoed
from addon.servers.credentials import redacted
from addon.servers.engines import RENDERS_ON_ASKING
from addon.servers.exchange import Exchange
from addon.servers.upstream import Response, Upstream, UpstreamError, post, sent_headers

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Legs:
    # The client's request as each first leg sends it: `raw_body` as sent (with the ids
    # the addon asks for, `strip_pieces` then naming them), `headers` as forwarded.
    path: str
    dialect: Dialect
    body: dict[str, Any]
    raw_body: bytes
    headers: list[Header]
    streaming: bool
    strip_pieces: str | None
    primary: Upstream
    fleet: Fleet
    transcript: Transcript
    handoffs: list[Handoff]  # the splice's own list: each later leg continues after the last
    early: EarlyRefusals
    resume: Resume
    notes: Notes
    may_move: Callable[[], bool]  # whether another server could go on if this leg failed now
    handing_off: Callable[[], bool]  # whether a leg cancelled now was cut for a handoff
    on_handoff: Callable[[Handoff], None]
    on_exchange: Callable[[Exchange], None] | None  # None: legs are not kept
    accepted: bool = False  # the primary has answered: the client is one it lets in
    pace: Pace | None = None  # the current leg's
    pump: Pump | None = None  # the current leg's while it is pushed
    finishing: bool = False  # the answer's end has been seen: no handoff may cut it
    # A migrated leg's note waits for its first token.
    _tell_at_first_byte: bool = field(default=False, init=False)

    async def stream(self, client: ClientStream, upstream: Upstream) -> str | None:
        """Stream one leg from `upstream` into the client. None when the answer is
        complete, otherwise why the leg failed."""
        self.early.new_leg()
        limits = self.fleet.pace
        self.pace = Pace(time.monotonic(), limits) if limits.enabled() else None
        if not self.handoffs:
            body = self.raw_body
            if upstream != self.primary:
                own = self.fleet.servers.own_model(upstream, self.body.get("model"))
                body = rerouted(self.body, body, own)
            return await self._kept(client, upstream, self.path, body, None)
        try:
            failure = await self._continued(client, upstream, at_once=True)
            if failure == AGAIN:  # (the client has read nothing of it)
                failure = await self._continued(client, upstream, at_once=False)
            return failure
        finally:
            if self._tell_at_first_byte:  # the leg ended before its first byte
                self._tell_at_first_byte = False
                self.notes.tell(client, self.handoffs)

    async def _continued(
        self, client: ClientStream, upstream: Upstream, at_once: bool
    ) -> str | None:
        """The leg that continues the answer on `upstream` after the last handoff."""
        prepared = await self.resume.prepare(upstream, self.handoffs[-1], at_once)
        request, restored = prepared.request, prepared.restored
        try:
            if isinstance(request, str) or (restored is None and prepared.unchecked is None):
                self.notes.tell(client, self.handoffs)
            else:
                # Told with its first token: what a restore saved is known then, and a
                # request sent beside its recheck may yet be built again.
                self._tell_at_first_byte = True
            if isinstance(request, str):
                return request
            path, body, rewriter = request
            return await self._kept(client, upstream, path, body, rewriter, prepared.unchecked)
        finally:
            if prepared.unchecked is not None:
                prepared.unchecked.cancel()
            if restored is not None:
                self.resume.release(upstream, restored)

    async def _kept(
        self, client: ClientStream, upstream: Upstream, path: str, body: bytes,
        rewriter: Rewriter | None, unchecked: asyncio.Future[str | None] | None = None,
    ) -> str | None:  # fmt: skip
        """The leg, as an exchange shown in mitmweb and recorded where legs are kept;
        `unchecked`: a recheck whose word (None, or why not) the leg's answer waits for."""
        headers = self.fleet.credentials.leg_headers(
            upstream.url, self.headers, upstream == self.primary, self.accepted
        )
        exchange = Exchange(
            upstream.url, "POST", path, redacted(sent_headers(upstream, body, headers)), body,
            purpose="leg", leg=len(self.handoffs),
        )  # fmt: skip
        try:
            failure = await self._exchange(
                client, upstream, path, body, headers, rewriter, exchange, unchecked
            )
        except asyncio.CancelledError:
            self._show(exchange, "handed off" if self.handing_off() else "cancelled")
            raise
        except BaseException as exc:
            self._show(exchange, "failed", repr(exc))
            raise
        self._show(exchange, "complete" if failure is None else "failed", failure)
        return failure

    def _show(self, exchange: Exchange, outcome: str, error: str | None = None) -> None:
        """The leg's exchange is over: shown once, where legs are kept. An answer's last
        leg is shown before the answer's last bytes go out: mitmproxy records the client's
        flow (-w) the moment it ends, with the legs it names."""
        if exchange.ended is not None:
            return
        exchange.end(outcome, error)
        if self.on_exchange is not None:
            self.on_exchange(exchange)

    async def _exchange(
        self, client: ClientStream, upstream: Upstream, path: str, body: bytes,
        headers: list[Header], rewriter: Rewriter | None, exchange: Exchange,
        unchecked: asyncio.Future[str | None] | None,
    ) -> str | None:  # fmt: skip
        fleet, pace = self.fleet, self.pace
        if pace is not None:
            read_ms = fleet.migrator.rates.read_ms.get(upstream.url)
            firsts = fleet.first_events
            pace.first_token_s = fleet.pace.first_token_deadline(
                len(body), read_ms, firsts.of(upstream.url)
            )
            pace.on_first = lambda seconds: firsts.saw(upstream.url, len(body), seconds)
        try:
            response = await post(upstream, path, body, headers)
        except UpstreamError as exc:
            fleet.mark_down(upstream, str(exc))
            return str(exc)
        if unchecked is not None and (changed := await self._checked(response, unchecked)):
            return changed  # unread: built for what the server no longer is
        exchange.respond(response.status, response.headers)
        if pace is not None:
            pace.saw(time.monotonic())
        if upstream == self.primary and 200 <= response.status < 300:
            self.accepted = True
        if self.on_exchange is not None:
            response.tap = exchange.keep
        try:
            if response.status != 200:
                return await self.early.refused(
                    response, upstream, path, client, self.primary, not self.handoffs
                )
            if not self.streaming:
                answer = await response.read_all()
                notes = self.notes.headers(self.handoffs)
                self._show(exchange, "complete")
                client.respond(200, [*response.headers, *notes], answer, response.reason)
                return None
            if not client.started:
                client.start(200, list(response.headers), response.reason)
            self.notes.release(client)
            info = fleet.servers.get(upstream)
            raw_pieces = info.engine in RENDERS_ON_ASKING
            echoes = prefill_echoed(self.body, info)  # where it writes the answer's first text
            self.transcript.begin_leg(upstream.url, info.tokenizer, raw_pieces, echoes)
            reader = self.dialect.reader(self.transcript, rewriter, self.strip_pieces, upstream.url)
            pump = Pump(
                client, self.transcript, reader, pace,
                flush=lambda out: self._flush(client, out), finishing=self._mark_finishing,
                may_move=self.may_move, ending=lambda: self._show(exchange, "complete"),
            )  # fmt: skip
            if isinstance(rewriter, Adapter):
                failure = await pump.run(rewriter.adapt(response.body()), upstream.url)
            else:
                self.pump = pump
                failure = await pump.run_pushed(response, upstream.url)
            if failure is not None and pump.closed:
                fleet.mark_down(upstream, "closed the stream mid-answer")
            return failure
        except UpstreamError as exc:
            fleet.mark_down(upstream, str(exc))
            return str(exc)
        finally:
            self.pump = None
            response.close()

    @staticmethod
    async def _checked(response: Response, unchecked: asyncio.Future[str | None]) -> str | None:
        """The recheck's word on a leg sent beside it; where it says no (or the leg is
        cancelled meanwhile), the response is closed unread."""
        try:
            changed = await unchecked
        except BaseException:
            response.close()
            raise
        if changed is not None:
            response.close()
        return changed

    def _mark_finishing(self) -> None:
        self.finishing = True

    def _flush(self, client: ClientStream, out: list[bytes]) -> None:
        if not out:
            return
        if self._tell_at_first_byte:
            self._tell_at_first_byte = False
            self.notes.tell(client, self.handoffs)
        client.write(b"".join(out))
        if self.handoffs and self.handoffs[-1].pause_ms is None:
            handoff = self.handoffs[-1]
            handoff.pause_ms = (time.monotonic() - handoff.decided) * 1000
            self.on_handoff(handoff)
            log.info("%s %s", handoff.kind, handoff.describe())
