"""The Spillover addon: options, hooks and the `spillover.handoff` command."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from mitmproxy import command, ctx, exceptions, flow, http
from mitmproxy.proxy.mode_specs import ReverseMode

from addon.answer.early import add_refusal_options
from addon.answer.endpoint import SpliceEndpoint, as_the_client_reads
from addon.answer.fleet import Fleet
from addon.answer.pace import add_pace_options, limits_from
from addon.answer.splice import Splice
from addon.formats.carried import SPLICED, arrives_in_pieces, recorded, spliceable
from addon.handoff.migration import add_migration_options
from addon.handoff.record import Handoff, Sensed
from addon.handoff.shadow import add_shadow_options
from addon.servers import keyed, tls
from addon.servers.addresses import same_address, same_server, url_of
from addon.servers.exchange import Exchange
from addon.servers.upstream import Upstream
from addon.servers.urlchecks import option_mistakes
from addon.surface.clientwire import add_client_wire_options, hand_over_when_passed
from addon.surface.control import CONTROL_PREFIX, Control, add_access_options
from addon.surface.flows import as_flow, bodies_kept, flows_kept, show, show_handoffs, show_leg
from addon.surface.listenqueue import listen_deeper
from addon.surface.live import LiveAnswers
from addon.surface.metrics import Metrics
from addon.surface.mistakes import given_twice, refuse_at_start, unknown_options
from addon.surface.openfiles import raise_for_answers
from addon.surface.siblings import PEER, add_sibling_options
from addon.surface.status import assemble_status

log = logging.getLogger(__name__)
PACE_TICK_S = 0.25  # how often live legs are checked for stalls and slowdowns
# The options that name the servers, and where the proxy itself listens.
SERVER_OPTIONS = {"spillover_primary", "spillover_fallbacks", "mode", "listen_host", "listen_port"}


def _refuse_to_start(mistakes: list[str]) -> bool:
    """Say each mistake in how the proxy was started; False when there is none. Errors
    logged while it starts end mitmproxy with status 1 (its errorcheck addon); shut down
    from here instead, it ended with 0, or crashed, before its listeners were up."""
    if mistakes:
        mistakes = [*mistakes, "not started; fix the options above"]
    return refuse_at_start(mistakes)


class Spillover:
    def __init__(self) -> None:
        self.endpoint = SpliceEndpoint()
        self.live = LiveAnswers(self.endpoint)
        self.fleet = Fleet(on_question=self._show_question)
        self.fleet.router.heard = self.live.heard
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pace_watch: asyncio.Future[None] | None = None
        self._health_watch: asyncio.Future[None] | None = None
        self.status_parts: dict[str, Callable[[], Any]] = {}  # other addons' status
        self.metrics = Metrics(self.status)
        self.control = Control(
            self._requested_handoff, self.status, self.metrics.render, self._drain
        )

    def load(self, loader) -> None:
        # A line per request of the addon's own httpx clients (its questions to servers)
        # would drown what an operator reads; their failures are said where they matter.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        # httpcore's trace of each request (a dozen debug records) is never shown, but
        # mitmproxy's root logger takes every record and passes it to each addon.
        logging.getLogger("httpcore").setLevel(logging.INFO)
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
        loader.add_option(
            "spillover_models", str, "",
            "Comma-separated URL=model pairs: the model a server that serves several is "
            "asked in (default: the first its /v1/models lists).",
        )  # fmt: skip
        loader.add_option(
            "spillover_templates", str, "",
            "Comma-separated URL=file pairs: the GGUF or tokenizer_config.json whose chat "
            "template a server's prompts are rendered from, to continue an answer through "
            "its /v1/completions when its chat route cannot (a llama-cpp-python server's "
            "own GGUF is found without it).",
        )  # fmt: skip
        loader.add_option(
            "spillover_continue_by", str, "",
            "Comma-separated URL=WAY pairs: how a server the addon cannot prove (a hosted "
            "API, LM Studio, a gateway) continues a partial answer, by its operator's word: "
            "message (a trailing assistant message), message-echoed (the same, repeated "
            "back first) or final-message (with continue_final_message). Used by text "
            "only, each continuation's first words checked; said as declared, not proven.",
        )  # fmt: skip
        add_pace_options(loader)
        add_refusal_options(loader)
        add_shadow_options(loader)
        add_migration_options(loader)
        loader.add_option(
            "spillover_health_s", int, 1,
            "Ask each server's /health this often (seconds); one that fails is down and gets "
            "no new request until it answers again (one that times out while the server "
            "writes to a live answer, or while its processes on this machine keep a core "
            "busy, is a loaded server's, not a failure, for up to a minute). 0: never ask.",
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
        add_sibling_options(loader)
        add_client_wire_options(loader)
        _refuse_to_start(given_twice(ctx.options.deferred))

    def configure(self, updated: set[str]) -> None:
        fleet, options, running = self.fleet, ctx.options, self._loop is not None
        if updated & SERVER_OPTIONS and (mistakes := option_mistakes(options)):
            if running:  # a change (mitmweb's options, `set`): mitmproxy keeps the old value
                raise exceptions.OptionsError("; ".join(mistakes))
            _refuse_to_start(mistakes)  # one line each: a raise here shows a traceback
            return
        if updated & tls.OPTIONS and (
            mistake := tls.use_upstream_tls(
                options.ssl_insecure,
                options.ssl_verify_upstream_trusted_ca,
                options.ssl_verify_upstream_trusted_confdir,
            )
        ):
            if running:
                raise exceptions.OptionsError(mistake)
            _refuse_to_start([mistake])
            return
        fleet.exact, fleet.pace = options.spillover_exact_replay, limits_from(options)
        fleet.retry_server_errors = options.spillover_retry_5xx
        fleet.busy_wait_s = max(0, options.spillover_busy_wait_s)
        if updated & {"spillover_shadow_max", "spillover_shadow_every"}:
            fleet.shadows.budget.limit = options.spillover_shadow_max
            fleet.shadows.budget.every = max(1, options.spillover_shadow_every)
        if "spillover_control_token" in updated:
            self.control.configure(options.spillover_control_token)
        if "spillover_siblings" in updated:
            self.control.siblings.configure(options.spillover_siblings)
        if "spillover_slot_dir" in updated:
            fleet.use_slot_dir(
                options.spillover_slot_dir, self._known_primaries() if running else None
            )
        if updated & (SERVER_OPTIONS | keyed.IN_SPILLOVER):
            try:
                self._use_servers(running)
            except ValueError as exc:  # an entry that names none of the servers, say
                if running:
                    raise exceptions.OptionsError(str(exc)) from None
                refuse_at_start([str(exc)])
                return
        if "spillover_fallbacks" in updated:
            fleet.use_fallbacks(keyed.fallbacks_of(options), running)

    def _use_servers(self, running: bool) -> None:
        """The options that name servers, each kept by the server it names
        (servers/keyed.py); all are matched before any is used, so that a mistake
        leaves them all as they were."""
        options, directory = ctx.options, self.fleet.servers
        servers = keyed.configured_servers(options)
        credentials = keyed.credentials_of(options, servers)
        models, files, ways = (
            keyed.by_server(name, getattr(options, name), servers)
            for name in (keyed.MODELS, keyed.TEMPLATES, keyed.WAYS)
        )
        self.fleet.use_credentials(credentials)
        directory.name_models(models, running)
        directory.name_templates(files, running)
        directory.declare_ways(ways, running)

    async def running(self) -> None:
        if _refuse_to_start(unknown_options(ctx.options.deferred, ctx.options.keys())):
            return
        self._loop = asyncio.get_running_loop()
        # A dead primary must not fail the client's connection before the request hook
        # can send it elsewhere, and stitched answers should be kept in flows and -w files
        # (where there are some: a person may still set store_streamed_bodies).
        ctx.options.update(connection_strategy="lazy")
        if bodies_kept():
            ctx.options.update(store_streamed_bodies=True)
        self.status_parts["open_files"] = raise_for_answers().status
        await self.endpoint.start()
        self.status_parts["splice_endpoint"] = self.endpoint.status
        if (server := ctx.master.addons.get("proxyserver")) is not None:
            listen_deeper({address[1] for address in server.listen_addrs()})
        self._pace_watch = asyncio.ensure_future(self._watch_pace())
        if every := ctx.options.spillover_health_s:
            self._health_watch = asyncio.ensure_future(
                self.fleet.router.watch_health(self.server_urls, every)
            )
        self.fleet.servers.learn(self._known_primaries())
        self.fleet.servers.learn(self.fleet.fallbacks, fallbacks=True)
        log.info(
            "spillover: carrying %s; fallbacks: %s",
            ", ".join(SPLICED),
            ", ".join(u.url for u in self.fleet.fallbacks) or "none",
        )
        if not self.fleet.fallbacks:
            log.warning(
                "spillover: no fallbacks (spillover_fallbacks): answers are carried, but "
                "none can move when its server runs short or fails"
            )
        self.control.ready = True
        # What start-up made (mitmproxy, this addon, their imports) lives as long as the
        # process: kept out of the collector's full passes, which otherwise walk all of it
        # and stop every stream for tens of ms each time (docs/benchmarks.md).
        gc.freeze()

    async def done(self) -> None:
        for watch in (self._pace_watch, self._health_watch):
            if watch is not None:
                watch.cancel()
        self.live.cancel_all()
        await self.fleet.close()
        await self.endpoint.stop()

    async def _watch_pace(self) -> None:
        while True:
            await asyncio.sleep(PACE_TICK_S)
            options = ctx.options
            back = options.spillover_hand_back_min_tokens if options.spillover_hand_back else None
            self.live.check(time.monotonic(), self.fleet, back, options.spillover_shadow)

    def server_urls(self) -> list[str]:
        """The primary (the reverse-proxy target unless set) and the fallbacks."""
        return [u.url for u in (*self._known_primaries(), *self.fleet.fallbacks)]

    def _known_primaries(self) -> list[Upstream]:
        return [Upstream(url) for url in keyed.primaries_of(ctx.options)]

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or flow.error is not None or recorded(flow):
            return  # answered already: a flow read from a file (-r), or another addon's
        if flow.request.path.startswith(CONTROL_PREFIX) and self.control.admits(flow):
            await self.control.answer(flow)
            return
        flow.request.headers.pop(PEER, None)  # HAProxy's word to the control routes only
        if not self.endpoint.running or (carried := spliceable(flow.request)) is None:
            return
        if (primary := _primary_of(flow)) is None:
            return  # taken by the transparent or local mode on its way to another server
        body, dialect = carried
        request = flow.request
        route = self.fleet.route(Upstream(primary), dialect.upper_bound(body))
        splice = Splice(
            path=request.path,
            dialect=dialect,
            headers=list(request.headers.fields),
            body=body,
            raw_body=request.content or b"",
            route=route,
            fleet=self.fleet,
            answer=flow.id,
            on_handoff=lambda handoff: self._record(flow, handoff),
            on_exchange=(lambda exchange: show_leg(flow, exchange)) if flows_kept() else None,
        )
        flow.metadata["spillover"] = {
            "ladder": [u.url for u in splice.ladder],
            "handoffs": [],
            "exact_replay": self.fleet.exact,
        }
        self.live.start(flow, splice)  # it runs once the flow reaches the endpoint

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is None:
            return
        if (splice := self.live.answering(flow)) is not None:
            if (client_head := as_the_client_reads(flow.response.headers.fields)) is not None:
                # A copy for the client: mitmproxy reads the endpoint's body by the head
                # it read (to the connection's close), and sends the client this one.
                flow.response = flow.response.copy()
                flow.response.headers.fields = client_head
            flow.response.stream = splice.streaming
            if splice.streaming:
                hand_over_when_passed(flow, splice, self.endpoint)
        elif not flow.response.stream and arrives_in_pieces(flow.response):
            flow.response.stream = True  # as it comes; -w still keeps it whole

    def response(self, flow: http.HTTPFlow) -> None:
        # Answered by another addon, when the splice is still live: it stops.
        splice = self.live.end(flow.id)
        self.fleet.ended(flow.id, splice.transcript.reads if splice is not None else ())

    def error(self, flow: http.HTTPFlow) -> None:
        self.fleet.ended(flow.id)
        if (splice := self.live.end(flow.id)) is not None:
            splice.cancel()  # it was running for the endpoint's connection

    @command.command("spillover.handoff")
    def handoff(self, flows: Sequence[flow.Flow]) -> int:
        """Hand off the given live streams to their next server with room (@all: every
        one); returns how many are moving."""
        moves = self.live.hand_off(
            (f.id for f in flows), "requested by spillover.handoff", "requested"
        )
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
        """Drain a server of this proxy's (or let it take new requests again), named by any
        URL that reaches it; a URL that reaches none is refused, so what is kept stays
        bounded."""
        written, router = server.strip().rstrip("/"), self.fleet.router
        known = [*self.server_urls(), *(u.url for u in self.fleet.servers.info)]
        url = (
            written if written in known else next((k for k in known if _reaches(written, k)), None)
        )
        if url is None:
            return {"server": written[:200], "error": "not a server of this proxy"}
        if not on:
            router.draining.discard(url)
            return {"server": url, "state": self.fleet.state(url)}
        router.draining.add(url)
        ids = self.live.on({url})
        moves = self.live.hand_off(ids, f"{url} is draining", "requested")
        return {"server": url, "moving": len(moves), "live": len(ids)}

    def request_handoff(
        self, reason: str, servers: Iterable[str] | None = None, sensed: Sensed | None = None
    ) -> None:
        """Thread-safe: hand off every live stream whose current server is in `servers`
        (every live stream when None), for memory pressure. For watchers in other threads."""
        if self._loop is None:
            return
        wanted = None if servers is None else {s.rstrip("/") for s in servers}
        self._loop.call_soon_threadsafe(self._pressure_handoff, reason, wanted, sensed)

    def _pressure_handoff(
        self, reason: str, servers: set[str] | None, sensed: Sensed | None
    ) -> None:
        self.live.hand_off(self.live.on(servers), reason, "pressure", sensed)

    def _record(self, flow: http.HTTPFlow, handoff: Handoff) -> None:
        sensed = self.live.sensed(flow.id)
        if sensed is not None and handoff.kind == "pressure" and handoff.pause_ms is None:
            handoff.sensed(sensed)
        self.metrics.record(handoff)
        if (splice := self.live.get(flow.id)) is not None:
            show_handoffs(flow, splice.handoffs)

    def _show_question(self, exchange: Exchange) -> None:
        if flows_kept():
            show(as_flow(exchange))

    async def _requested_handoff(self, flow_id: str | None, reason: str) -> int:
        """Hand off one live answer, or all: how many moved."""
        ids = [flow_id] if flow_id else list(self.live.by_flow)
        moved = await asyncio.gather(
            *self.live.hand_off(ids, reason, "requested"), return_exceptions=True
        )
        return sum(m is True for m in moved)

    def status(self) -> dict[str, Any]:
        return assemble_status(
            self.live.splices(), self.fleet, self.server_urls(), self.metrics.recent(),
            self.status_parts,
        )  # fmt: skip


def _primary_of(flow: http.HTTPFlow) -> str | None:
    """The primary a flow's answer is carried from: spillover_primary, else where
    mitmproxy sends it (the reverse target, or the original destination of a redirected
    connection); None for a redirected flow whose destination is not spillover_primary."""
    request = flow.request
    named = ctx.options.spillover_primary.rstrip("/")
    if not named:
        return url_of(request.scheme, request.host, request.port)
    if isinstance(flow.client_conn.proxy_mode, ReverseMode):
        return named
    return named if same_server(named, request.host, request.port) else None


def _reaches(written: str, server: str) -> bool:
    """Whether a URL a person wrote reaches `server` (localhost for 127.0.0.1, the
    scheme's own port written out), without asking DNS: this runs on the event loop."""
    try:
        return same_address(written, server, resolve=False)
    except ValueError:
        return False
