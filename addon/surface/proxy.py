"""The Spillover addon: options, hooks and the `spillover.handoff` command."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mitmproxy import command, ctx, exceptions, flow, http
from mitmproxy.proxy.mode_specs import ProxyMode, ReverseMode

from addon.answer.endpoint import TOKEN_HEADER, SpliceEndpoint
from addon.answer.pace import add_pace_options, limits_from
from addon.answer.splice import Splice
from addon.formats.carried import SPLICED, arrives_in_pieces, recorded, spliceable
from addon.handoff.migration import Migrator, add_migration_options
from addon.handoff.record import Handoff, Sensed
from addon.handoff.shadow import Shadows, add_shadow_options
from addon.servers.credentials import Credentials, parse_keys
from addon.servers.directory import ServerDirectory
from addon.servers.exchange import Exchange, as_flow, flows_kept, show
from addon.servers.routing import Router
from addon.servers.upstream import Upstream
from addon.surface.control import CONTROL_PREFIX, Control, add_access_options
from addon.surface.metrics import Metrics
from addon.surface.status import assemble_status

log = logging.getLogger(__name__)
PACE_TICK_S = 0.25  # how often live legs are checked for stalls and slowdowns
MARK = ":twisted_rightwards_arrows:"


@dataclass
class _Live:
    splice: Splice
    token: str
    origin: tuple[str, str, int]  # scheme, host, port the request was bound for
    http_version: str  # the client's (the endpoint is asked in HTTP/1.1, see `request`)


class Spillover:
    def __init__(self) -> None:
        self.endpoint = SpliceEndpoint()
        self.fallbacks: list[Upstream] = []
        self.live: dict[str, _Live] = {}
        self._sensed: dict[str, Sensed] = {}  # flow id -> what the watcher saw, until moved
        self.servers = ServerDirectory(on_exchange=self._show_question)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pace_watch: asyncio.Future[None] | None = None
        self._health_watch: asyncio.Future[None] | None = None
        self.status_parts: dict[str, Callable[[], Any]] = {}  # other addons' status
        self.metrics = Metrics(self.status)
        self.router = Router()
        self.control = Control(
            self._requested_handoff, self.status, self.metrics.render, self._drain
        )
        self.credentials = Credentials()
        self.shadows = Shadows(lambda url: self.credentials.question_headers(url))
        self.migrator = Migrator(None, headers=lambda url: self.credentials.question_headers(url))

    def load(self, loader) -> None:
        loader.add_option(
            "spillover_fallbacks", str, "",
            "Comma-separated fallback servers, in the order to try them "
            "(e.g. http://127.0.0.1:8082,http://127.0.0.1:8083).",
        )  # fmt: skip
        loader.add_option(
            "spillover_primary", str, "",
            "The primary server's URL. Default: wherever mitmproxy sends the request "
            "(the reverse-proxy target).",
        )  # fmt: skip
        loader.add_option(
            "spillover_exact_replay", bool, True,
            "Continue from the exact token ids when primary and fallback share a tokenizer "
            "(asks the primary for each token's id; the client does not see them).",
        )  # fmt: skip
        loader.add_option(
            "spillover_upstream_flows", bool, True,
            "Show and record the addon's own upstream requests (each leg of an answer, "
            "the questions it asks servers) as flows of their own.",
        )  # fmt: skip
        add_pace_options(loader)
        add_shadow_options(loader)
        add_migration_options(loader)
        loader.add_option(
            "spillover_health_s", int, 1,
            "Ask each server's /health this often (seconds); one that fails is down and gets "
            "no new request until it answers again. 0: never ask.",
        )  # fmt: skip
        loader.add_option(
            "spillover_hand_back", bool, False,
            "Move an answer that left the primary for memory pressure or a slowdown (or "
            "started elsewhere) back to it once it is ok again (clear for spillover_dwell_s).",
        )  # fmt: skip
        loader.add_option(
            "spillover_hand_back_min_tokens", int, 200,
            "...unless fewer tokens than this are still to come (when the request says).",
        )  # fmt: skip
        add_access_options(loader)

    def configure(self, updated: set[str]) -> None:
        if updated & {"spillover_shadow_max", "spillover_shadow_every"}:
            self.shadows.budget.limit = ctx.options.spillover_shadow_max
            self.shadows.budget.every = max(1, ctx.options.spillover_shadow_every)
        if "spillover_control_token" in updated:
            self.control.configure(ctx.options.spillover_control_token)
        if updated & {"spillover_server_keys", "spillover_forward_credentials"}:
            self.credentials = Credentials(
                parse_keys(ctx.options.spillover_server_keys),
                ctx.options.spillover_forward_credentials,
            )
            self.servers.credentials = self.credentials
        if "spillover_slot_dir" in updated:
            self._configure_migration(ctx.options.spillover_slot_dir)
        if "spillover_fallbacks" in updated:
            urls = [u.strip().rstrip("/") for u in ctx.options.spillover_fallbacks.split(",")]
            self.fallbacks = [Upstream(u) for u in urls if u]
            if self._loop is not None:
                self.servers.learn(self.fallbacks, fallbacks=True)

    def _configure_migration(self, directory: str) -> None:
        self.servers.slot_dir = self.migrator.directory = Path(directory) if directory else None
        if directory and self._loop is not None:
            self.servers.learn([*self._known_primaries(), *self.fallbacks])

    async def running(self) -> None:
        self._loop = asyncio.get_running_loop()
        # A dead primary must not fail the client's connection before the request hook
        # can send it elsewhere, and stitched answers should be kept in flows and -w files.
        ctx.options.update(connection_strategy="lazy", store_streamed_bodies=True)
        await self.endpoint.start()
        self._pace_watch = asyncio.ensure_future(self._watch_pace())
        if every := ctx.options.spillover_health_s:
            self._health_watch = asyncio.ensure_future(
                self.router.watch_health(self.server_urls, every)
            )
        self.servers.learn(self._known_primaries())
        self.servers.learn(self.fallbacks, fallbacks=True)
        log.info(
            "spillover: carrying %s; fallbacks: %s",
            ", ".join(SPLICED),
            ", ".join(u.url for u in self.fallbacks) or "none",
        )

    async def done(self) -> None:
        for watch in (self._pace_watch, self._health_watch):
            if watch is not None:
                watch.cancel()
        for live in self.live.values():
            live.splice.cancel()
        await self.shadows.close()
        await self.migrator.close()
        await self.endpoint.stop()
        await self.servers.close()

    async def _watch_pace(self) -> None:
        while True:
            await asyncio.sleep(PACE_TICK_S)
            now = time.monotonic()
            back, shadow = ctx.options.spillover_hand_back, ctx.options.spillover_shadow
            for flow_id, live in list(self.live.items()):
                try:
                    live.splice.check_pace(now)
                    if back and self.router.state(live.splice.primary.url)[0] == "ok":
                        live.splice.hand_back(ctx.options.spillover_hand_back_min_tokens)
                    self.shadows.tick(flow_id, live.splice, shadow)
                except Exception:
                    log.exception("pace check of %s failed", flow_id)

    def server_urls(self) -> list[str]:
        """The primary (the reverse-proxy target unless set) and the fallbacks."""
        return [u.url for u in (*self._known_primaries(), *self.fallbacks)]

    def _known_primaries(self) -> list[Upstream]:
        if ctx.options.spillover_primary:
            return [Upstream(ctx.options.spillover_primary.rstrip("/"))]
        targets = []
        for spec in ctx.options.mode:
            mode = ProxyMode.parse(spec)
            if isinstance(mode, ReverseMode):
                host, port = mode.address
                targets.append(Upstream(f"{mode.scheme}://{host}:{port}"))
        return targets

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or flow.error is not None or recorded(flow):
            return  # answered already: a flow read from a file (-r), or another addon's
        if flow.request.path.startswith(CONTROL_PREFIX) and self.control.admits(flow):
            await self.control.answer(flow)
            return
        if not self.endpoint.running:
            return
        if (carried := spliceable(flow.request)) is None:
            return
        body, dialect = carried
        request = flow.request
        origin = (request.scheme, request.host, request.port)
        primary = Upstream(ctx.options.spillover_primary or "{}://{}:{}".format(*origin))
        self.servers.learn([primary])  # known from start-up, unless it is not the proxy target
        locked = self.servers.wanting_keys()
        ladder, route_note = self._ladder_for(primary, dialect.upper_bound(body), locked)
        splice = Splice(
            path=request.path,
            dialect=dialect,
            headers=list(request.headers.fields),
            body=body,
            raw_body=request.content or b"",
            ladder=ladder,
            primary=primary,
            state_of=lambda url: self.router.state(url)[0],
            on_down=lambda server, why: self.router.mark_down(server.url, why),
            route_note=route_note,
            settle=lambda server: self.shadows.settled(flow.id, server),
            migrator=self.migrator if self.migrator.directory else None,
            servers=self.servers,
            on_handoff=lambda handoff: self._record(flow, handoff),
            on_exchange=(
                (lambda exchange: self._show_leg(flow, exchange)) if flows_kept() else None
            ),
            exact=ctx.options.spillover_exact_replay,
            credentials=self.credentials,
            locked=locked,
            pace=limits_from(ctx.options),
        )
        flow.metadata["spillover"] = {
            "ladder": [u.url for u in splice.ladder],
            "handoffs": [],
            "exact_replay": ctx.options.spillover_exact_replay,
        }
        live = self.live[flow.id] = _Live(splice, "", origin, request.http_version)
        live.token = self.endpoint.expect(splice)  # the first leg starts now
        request.scheme, request.host, request.port = "http", "127.0.0.1", self.endpoint.port
        # So that the endpoint frames a stream as llama-server does for any client
        # (chunked), not as h11 must for an HTTP/1.0 one (until the connection closes).
        request.http_version = "HTTP/1.1"
        request.headers[TOKEN_HEADER] = live.token

    def _ladder_for(
        self, primary: Upstream, bound: int | None, locked: frozenset[str]
    ) -> tuple[list[Upstream], str | None]:
        """The servers a new answer (of at most `bound` tokens) may use, the one it starts
        on first, and why it does not start on the primary (when it does not); `locked`:
        servers that want a key the addon was not given."""
        ladder = [primary, *self.fallbacks]

        def may_start(server: Upstream) -> bool:
            context = self.servers.get(server).slot_context
            fits = context is None or bound is None or bound <= context
            return server == primary or (
                fits and self.credentials.may_start_on(server.url, primary.url, locked)
            )

        return self.router.plan(ladder, may_start)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        live = self.live.get(flow.id)
        if flow.response is None:
            return
        if live is None:
            if not flow.response.stream and arrives_in_pieces(flow.response):
                flow.response.stream = True  # as it comes; -w still keeps it whole
            return
        flow.response.stream = live.splice.streaming
        # The request has gone to the endpoint: show and record it as sent to the primary.
        flow.request.scheme, flow.request.host, flow.request.port = live.origin
        flow.request.http_version = live.http_version
        flow.request.headers.pop(TOKEN_HEADER, None)

    def response(self, flow: http.HTTPFlow) -> None:
        live = self.live.pop(flow.id, None)
        if live is not None:
            self.endpoint.forget(live.token)  # answered by another addon: the splice stops
            self.migrator.rates.learn(live.splice.transcript.reads)
        self._sensed.pop(flow.id, None)
        self.shadows.ended(flow.id)

    def error(self, flow: http.HTTPFlow) -> None:
        self._sensed.pop(flow.id, None)
        self.shadows.ended(flow.id)
        live = self.live.pop(flow.id, None)
        if live is not None:
            self.endpoint.forget(live.token)
            live.splice.cancel()  # it was running for the endpoint's connection

    @command.command("spillover.handoff")
    def handoff(self, flows: Sequence[flow.Flow]) -> int:
        """Hand off the given live streams to their next server with room (@all: every
        one); returns how many are moving."""
        moves = self._handoff((f.id for f in flows), "requested by spillover.handoff", "requested")
        return len(moves)

    @command.command("spillover.drain")
    def drain_command(self, server: str) -> int:
        """Move every live answer off a server and start no new one there; returns how
        many answers are moving."""
        drained = self._drain(server, True)
        if "error" in drained:
            raise exceptions.CommandError(drained["error"])
        return drained["moving"]

    @command.command("spillover.undrain")
    def undrain_command(self, server: str) -> None:
        """Let a drained server take new requests again."""
        self._drain(server, False)

    def _drain(self, server: str, on: bool) -> dict[str, Any]:
        """Drain a server of this proxy's (or let it take new requests again); a name
        that is not one is refused, so what is kept stays bounded."""
        url = server.strip().rstrip("/")
        if url not in {*self.server_urls(), *(u.url for u in self.servers.info)}:
            return {"server": url[:200], "error": "not a server of this proxy"}
        if not on:
            self.router.draining.discard(url)
            return {"server": url, "state": self.router.state(url)[0]}
        self.router.draining.add(url)
        ids = self._live_on({url})
        moves = self._handoff(ids, f"{url} is draining", "requested")
        return {"server": url, "moving": len(moves), "live": len(ids)}

    def request_handoff(
        self, reason: str, servers: Iterable[str] | None = None, sensed: Sensed | None = None
    ) -> None:
        """Thread-safe: hand off every live stream whose current server is in `servers`
        (every live stream when None), for memory pressure. For watchers in other threads."""
        if self._loop is None:
            return
        wanted = None if servers is None else {s.rstrip("/") for s in servers}
        self._loop.call_soon_threadsafe(self._handoff_on, reason, wanted, sensed)

    def _handoff_on(self, reason: str, servers: set[str] | None, sensed: Sensed | None) -> None:
        flow_ids = self._live_on(servers)
        if sensed is not None:
            self._sensed.update(dict.fromkeys(flow_ids, sensed))
        self._handoff(flow_ids, reason, "pressure")

    def _live_on(self, servers: set[str] | None) -> list[str]:
        """The live answers whose current server is one of `servers` (None: all)."""
        return [
            flow_id
            for flow_id, live in self.live.items()
            if servers is None or live.splice.current.url in servers
        ]

    def _handoff(
        self, flow_ids: Iterable[str], reason: str, kind: str
    ) -> list[asyncio.Future[bool]]:
        """Ask each stream to move; one stream's trouble never keeps another from moving."""
        moves = []
        for flow_id in list(flow_ids):
            live = self.live.get(flow_id)
            if live is None:
                continue
            try:
                move = live.splice.handoff(reason, kind)
            except Exception:
                log.exception("handoff of %s failed; it stays where it is", flow_id)
                continue
            if move is not None:
                move.add_done_callback(_log_failed_move)
                moves.append(move)
        return moves

    def _record(self, flow: http.HTTPFlow, handoff: Handoff) -> None:
        sensed = self._sensed.pop(flow.id, None)
        if sensed is not None and handoff.kind == "pressure" and handoff.pause_ms is None:
            handoff.sensed(sensed)
        if handoff.pause_ms is None:
            self.shadows.handed_off(flow.id)
        self.metrics.record(handoff)
        live = self.live.get(flow.id)
        if live is None:
            return
        handoffs = live.splice.handoffs
        flow.metadata["spillover"]["handoffs"] = [h.as_metadata() for h in handoffs]
        flow.comment = "\n".join(f"spillover: {h.describe()}" for h in handoffs)
        flow.marked = MARK

    def _show_question(self, exchange: Exchange) -> None:
        if flows_kept():
            show(as_flow(exchange))

    def _show_leg(self, answer: http.HTTPFlow, exchange: Exchange) -> None:
        leg = as_flow(exchange, answer)
        answer.metadata["spillover"].setdefault("legs", []).append(leg.id)
        show(leg)

    async def _requested_handoff(self, flow_id: str | None, reason: str) -> int:
        """Hand off one live answer, or all: how many moved."""
        moves = self._handoff([flow_id] if flow_id else list(self.live), reason, "requested")
        moved = await asyncio.gather(*moves, return_exceptions=True)
        return sum(m is True for m in moved)

    def status(self) -> dict[str, Any]:
        return assemble_status(self)


def _log_failed_move(move: asyncio.Future[bool]) -> None:
    if not move.cancelled() and (exc := move.exception()) is not None:
        log.error("a handoff could not be carried out; the answer stays", exc_info=exc)
