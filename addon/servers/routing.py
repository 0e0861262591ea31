"""Where a new request starts: each server's state, from what the addon measures.

- ok;
- pressured: a card it uses is over a line, or fired and has not yet been clear for the
  dwell time (the memory watcher says so);
- down: it refused a connection, died mid-answer or stalled, or its `GET /health` (asked
  every second) failed; back as soon as /health answers. A /health that times out while
  the server streams to a live answer, or while its processes here keep a core busy, is
  a loaded server's, for up to a minute;
- busy: it refused a request for now (408, 429, 503: servers/refusals.py); it gets no
  new request for its Retry-After;
- draining: a person asked (`spillover.drain`); it gets no new request;
- unknown: a card it uses has no fresh reading (a remote card whose Prometheus does not
  answer, a series gone stale): not known to be fine, so an ok server is preferred.

A new request starts on the first server of its ladder that is ok (a primary that is
unknown counts as ok: not knowing is no reason to leave it), else on the first unknown,
else on the first that is up (pressured beats down: it may yet survive). Drop fast,
climb slow: the primary gets new requests again only once its card has stayed clear for
the dwell.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from addon.servers.health import HealthQuestions
from addon.servers.upstream import Unreachable, Upstream, UpstreamError
from watchers.cputime import ServerProcesses

log = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 1.0
# A /health that times out is looked at again: the CPU its server's processes use over
# this window says whether it is working or waiting.
WORKING_WINDOW_S = 0.5
# A server whose /health has gone unanswered this long is down, however busy: a new
# request would wait about as long to start.
SLOW_HEALTH_LIMIT_S = 60.0
# A server in these states takes answers as usual (ok preferred): a primary in them keeps
# new requests, and a 5xx of its is asked again.
CALM = ("ok", "unknown")


@dataclass
class Down:
    why: str
    since: float
    # Whether its /health said it was loading (refused the connection, or answered 5xx,
    # as llama-server does until its model is loaded), not merely slow to answer.
    loading: bool = False


class Router:
    def __init__(self, on_back: Callable[[str], None] = lambda _: None) -> None:
        """`on_back(url)`: a server that was down answers again (it may have changed)."""
        self.on_back = on_back
        self.health = HealthQuestions(HEALTH_TIMEOUT_S)
        # The memory watcher's word on a server's cards: ("pressured" or "unknown", why),
        # or None when they are clear (or not watched).
        self.memory: Callable[[str], tuple[str, str] | None] = lambda _: None
        # Told when a server comes up after loading (its /health answers after it refused
        # connections or answered 5xx since the time given): what it took of its cards
        # while loading is its own (the memory watcher re-bases them).
        self.came_up: Callable[[str, float], None] = lambda _url, _since: None
        # When bytes last came from a server to a live answer (time.monotonic(); 0.0 when
        # none is streaming from it). A server whose /health times out while it streams,
        # or while its processes here keep a core busy, is loaded, not hung: vLLM answers
        # /health on the event loop its requests keep busy (seconds late under load), and
        # a busy server marked down would leave its model unused for new requests.
        self.heard: Callable[[str], float] = lambda _url: 0.0
        self.processes = ServerProcesses()
        self.slow_health: dict[str, str] = {}  # server -> while what its /health is slow
        self.unanswered_since: dict[str, float] = {}  # /health timed out since, in a row
        self.slow_limit_s = SLOW_HEALTH_LIMIT_S
        self.down: dict[str, Down] = {}
        self.busy: dict[str, tuple[str, float]] = {}  # server -> (why, until)
        self.refusals: dict[str, int] = {}  # requests refused before their first byte, by kind
        self.draining: set[str] = set()
        self.reroutes: dict[str, int] = {}  # new requests started away from the primary, by why
        self.seconds_in: dict[tuple[str, str], float] = {}  # (server, state): time spent

    def state(self, url: str) -> tuple[str, str | None]:
        """(ok | unknown | pressured | down | draining, why)."""
        if url in self.draining:
            return "draining", "drained by request"
        if (down := self.down.get(url)) is not None:
            return "down", down.why
        if (busy := self.busy.get(url)) is not None:
            if time.monotonic() < busy[1]:
                return "busy", busy[0]
            del self.busy[url]
        if (judged := self.memory(url)) is not None:
            return judged
        return "ok", None

    def plan(
        self, ladder: list[Upstream], may_start: Callable[[Upstream], bool]
    ) -> tuple[list[Upstream], str | None]:
        """The ladder a new request uses, starting where it should, and why it does not
        start on the primary (None when it does). Servers passed over stay on the ladder
        after it, in their order: an answer can still end up there."""
        states = [self.state(u.url) if may_start(u) else ("closed", None) for u in ladder]

        def where(*wanted: str) -> list[int]:
            return [i for i, (state, _) in enumerate(states) if state in wanted]

        ok = [0] if states[0][0] == "unknown" else where("ok")
        # Nothing up: the primary, as without the addon.
        start = next(iter(ok + where("unknown") + where("pressured")), 0)
        if not start:
            return ladder, None
        state, why = states[0]
        self.reroutes[state] = self.reroutes.get(state, 0) + 1
        note = f"started on {ladder[start].url}: {ladder[0].url} is {state} ({why})"
        return [ladder[start], *ladder[:start], *ladder[start + 1 :]], note

    def mark_busy(self, url: str, seconds: float, why: str) -> None:
        """`url` refused a request for now: new requests start elsewhere for `seconds`."""
        until = time.monotonic() + seconds
        if url not in self.busy or self.busy[url][1] < until:
            self.busy[url] = (why, until)

    def refused(self, kind: str) -> None:
        self.refusals[kind] = self.refusals.get(kind, 0) + 1

    def mark_down(self, url: str, why: str, loading: bool = False) -> None:
        self.slow_health.pop(url, None)  # down is no busy server's slowness
        if url not in self.down:
            log.info("%s is down (%s): new requests start elsewhere until it answers", url, why)
            self.down[url] = Down(why, time.monotonic())
        self.down[url].loading |= loading

    async def watch_health(self, urls: Callable[[], list[str]], every_s: float) -> None:
        """Ask every server's /health every `every_s`: a server that does not answer, or
        answers 5xx (llama-server does while it loads), is down until it answers 200.
        Not through mitmproxy: these checks are not questions worth a flow each."""
        last = time.monotonic()
        try:
            while True:
                servers = urls()
                await asyncio.gather(*(self._check(url) for url in servers))
                now = time.monotonic()
                for url in servers:
                    key = (url, self.state(url)[0])
                    self.seconds_in[key] = self.seconds_in.get(key, 0.0) + now - last
                last = now
                await asyncio.sleep(every_s)
        finally:
            self.health.close()

    async def answers_health(self, url: str) -> bool:
        """Whether `url` answers /health with 200 now, asked once."""
        try:
            return await self.health.status(url) == 200
        except (UpstreamError, TimeoutError):
            return False

    async def _check(self, url: str) -> None:
        asked = time.monotonic()
        try:
            status = await self.health.status(url)
        except TimeoutError:
            since = self.unanswered_since.setdefault(url, asked)
            if url in self.down:
                return  # down until it answers
            if (busy := await self._busy(url, asked, since)) is not None:
                if self.slow_health.get(url) != busy:
                    log.info("%s is slow to answer /health %s: busy, not down", url, busy)
                    self.slow_health[url] = busy
                return
            self.mark_down(url, f"/health: no answer in {HEALTH_TIMEOUT_S:g} s")
            return
        except Unreachable as exc:
            self.unanswered_since.pop(url, None)
            # Not listening (yet), as while it loads; not a certificate it was refused
            self.mark_down(url, f"/health: cannot connect ({exc.reason})", not exc.tls)
            return
        except UpstreamError:
            self.unanswered_since.pop(url, None)
            self.mark_down(url, "/health: no response")
            return
        self.unanswered_since.pop(url, None)
        self.slow_health.pop(url, None)
        if status >= 500:
            self.mark_down(url, f"/health: HTTP {status}", loading=True)
        elif url in self.down:
            log.info("%s answers again", url)
            down = self.down.pop(url)
            if down.loading:
                self.came_up(url, down.since)
            self.on_back(url)

    async def _busy(self, url: str, asked: float, since: float) -> str | None:
        """Why a server whose /health timed out is busy rather than hung (None: nothing
        says so): it wrote to a live answer through this proxy after the check was asked,
        or the processes that hold its port on this machine keep using CPU."""
        if asked - since >= self.slow_limit_s:
            return None
        if self.heard(url) >= asked:
            return "while it streams"
        try:
            working = await asyncio.to_thread(self.processes.working, url, WORKING_WINDOW_S)
        except Exception:  # not knowing is no reason to stop checking: a timeout, as before
            log.exception("reading the CPU time of %s's processes failed", url)
            return None
        return "while its processes work" if working else None

    def status(self, urls: list[str]) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        states: dict[str, dict[str, Any]] = {}
        for url in urls:
            state, why = self.state(url)
            states[url] = {"state": state, "why": why}
            if (busy := self.slow_health.get(url)) is not None:
                states[url]["health"] = f"slow {busy}"
            if (down := self.down.get(url)) is not None:
                states[url]["for_s"] = round(now - down.since, 1)
        return states
