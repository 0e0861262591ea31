"""The answers streaming now, by flow: re-pointing each at the splice endpoint and back,
looking at each a few times a second, asking answers to move, and what the memory
watcher saw behind a pressure handoff."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from mitmproxy import http

from addon.answer.endpoint import TOKEN_HEADER, SpliceEndpoint
from addon.answer.fleet import Fleet
from addon.answer.splice import Splice
from addon.handoff.record import Sensed

log = logging.getLogger(__name__)


@dataclass
class _Live:
    splice: Splice
    token: str
    origin: tuple[bytes, str, int]  # scheme, host, port the request was bound for
    http_version: bytes  # the client's (the endpoint is asked in HTTP/1.1, see `start`)


class LiveAnswers:
    def __init__(self, endpoint: SpliceEndpoint) -> None:
        self.endpoint = endpoint
        self.by_flow: dict[str, _Live] = {}
        self._sensed: dict[str, Sensed] = {}  # what the watcher saw, until the answer moved

    def splices(self) -> dict[str, Splice]:
        return {flow_id: live.splice for flow_id, live in self.by_flow.items()}

    def get(self, flow_id: str) -> Splice | None:
        return live.splice if (live := self.by_flow.get(flow_id)) is not None else None

    def start(self, flow: http.HTTPFlow, splice: Splice) -> None:
        """Send the flow to the endpoint, where the splice runs once it arrives."""
        # The request's own fields, not their setters: those rewrite its Host header too,
        # there and back, for nothing (the endpoint reads no Host), on every answer.
        data = flow.request.data
        live = _Live(splice, "", (data.scheme, data.host, data.port), data.http_version)
        self.by_flow[flow.id] = live
        live.token = self.endpoint.expect(splice)
        data.scheme, data.host, data.port = b"http", "127.0.0.1", self.endpoint.port
        # So that h11 writes a whole answer as to any client, without the `Connection:
        # close` it adds for an HTTP/1.0 one (a stream's head the endpoint writes itself).
        data.http_version = b"HTTP/1.1"
        flow.request.headers[TOKEN_HEADER] = live.token

    def answering(self, flow: http.HTTPFlow) -> Splice | None:
        """The response has begun: the request, sent to the endpoint, is shown and
        recorded as sent to the primary again."""
        live = self.by_flow.get(flow.id)
        if live is None:
            return None
        data = flow.request.data
        data.scheme, data.host, data.port = live.origin
        data.http_version = live.http_version
        flow.request.headers.pop(TOKEN_HEADER, None)
        return live.splice

    def end(self, flow_id: str) -> Splice | None:
        """The flow is over (answered, or failed): its splice is forgotten."""
        self._sensed.pop(flow_id, None)
        live = self.by_flow.pop(flow_id, None)
        if live is None:
            return None
        self.endpoint.forget(live.token)
        return live.splice

    def sensed(self, flow_id: str) -> Sensed | None:
        """Once, what the watcher saw before the flow's answer was asked to move."""
        return self._sensed.pop(flow_id, None)

    def on(self, servers: set[str] | None) -> list[str]:
        """The live answers whose current server is one of `servers` (None: all)."""
        return [
            flow_id
            for flow_id, live in self.by_flow.items()
            if servers is None or live.splice.current.url in servers
        ]

    def heard(self, server: str) -> float:
        """When bytes last came from `server` to any live answer (time.monotonic()); 0.0
        when none did."""
        splices = (live.splice for live in self.by_flow.values())
        return max((s.heard for s in splices if s.current.url == server), default=0.0)

    def hand_off(
        self, flow_ids: Iterable[str], reason: str, kind: str, sensed: Sensed | None = None
    ) -> list[asyncio.Future[bool]]:
        """Ask each answer to move; one answer's trouble never keeps another from moving."""
        moves = []
        for flow_id in list(flow_ids):
            live = self.by_flow.get(flow_id)
            if live is None:
                continue
            if sensed is not None:
                self._sensed[flow_id] = sensed
            try:
                move = live.splice.handoff(reason, kind)
            except Exception:
                log.exception("handoff of %s failed; it stays where it is", flow_id)
                continue
            if move is not None:
                move.add_done_callback(_log_failed_move)
                moves.append(move)
        return moves

    def check(self, now: float, fleet: Fleet, hand_back_min: int | None, shadow: str) -> None:
        """Look at each live answer: its leg's pace, whether it should go back to its
        primary (`hand_back_min`: None never), its shadow (`shadow`: the mode)."""
        for flow_id, live in list(self.by_flow.items()):
            splice = live.splice
            try:
                splice.check_pace(now)
                if hand_back_min is not None and fleet.state(splice.primary.url) == "ok":
                    splice.hand_back(hand_back_min)
                fleet.shadows.tick(flow_id, splice, shadow)
            except Exception:
                log.exception("pace check of %s failed", flow_id)

    def cancel_all(self) -> None:
        for live in self.by_flow.values():
            live.splice.cancel()


def _log_failed_move(move: asyncio.Future[bool]) -> None:
    if not move.cancelled() and (exc := move.exception()) is not None:
        log.error("a handoff could not be carried out; the answer stays", exc_info=exc)
