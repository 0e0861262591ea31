"""One request's refusals (servers/refusals.py): a leg answered with another status than
200, whether the answer goes on to another server, and, before its first byte, when a
busy server that is the only one left is asked again.

A busy server (408, 429, 503) is marked so for its Retry-After, and new requests start
elsewhere meanwhile. A request the primary refused so, asking for a wait within the
owner's budget (`spillover_busy_wait_s`), waits exactly that long and is asked there
again, once: the primary is the model the client came for, and a short wait costs less
than an answer from a smaller one. Otherwise a request a server refused goes to the next
server with room. One whose
context is too small for the prompt passes the request to a server with more room, or
room not known. Where no other server can take it and the busy one asked for a short
wait, it is asked again after that wait, jittered, a few times at most; otherwise the
client gets the first refusal as the server sent it.

A server error (5xx other than 503) from the primary is asked once more there, at once,
when the owner allows it (the default): the primary is the model the client came for,
and a fallback is smaller. Only when the primary is under no memory pressure and answers
/health; otherwise, and with the option off, the request goes on down the ladder at once.
"""

from __future__ import annotations

import logging
import random
from typing import Any

from addon.answer.fleet import Fleet
from addon.answer.ladder import Ladder
from addon.formats.wire import ClientStream, Header
from addon.servers import refusals
from addon.servers.routing import CALM
from addon.servers.upstream import Response, Upstream

NOT_SERVED = {404, 405}  # a server that does not speak the client's API: the next is asked
SHORT_WAIT_S = 5.0  # the longest Retry-After waited out where no other server is left
RETRIES = 2
log = logging.getLogger(__name__)
Refusal = tuple[int, list[Header], bytes, bytes]  # status, headers, body, reason


def add_refusal_options(loader: Any) -> None:
    loader.add_option(
        "spillover_busy_wait_s", int, 3,
        "When the primary refuses a request as busy (408, 429, 503) with a Retry-After of "
        "at most this many seconds, wait that long and ask it once more before going to a "
        "fallback (0: go at once).",
    )  # fmt: skip
    loader.add_option(
        "spillover_retry_5xx", bool, True,
        "Ask the primary once more when it fails a request with a server error before "
        "its first byte, if it answers /health and is under no memory pressure (the "
        "answer stays on the big model); false: go to the next server at once.",
    )  # fmt: skip


class EarlyRefusals:
    def __init__(self, fleet: Fleet, ladder: list[Upstream], rungs: Ladder) -> None:
        self._fleet = fleet
        self._ladder = ladder
        self._rungs = rungs
        self.busy_wait: float | None = None  # the Retry-After of this leg's busy refusal
        self._server_error: int | None = None  # this leg's 5xx status
        self._retries = 0
        self._asked_again = False  # a server error was asked again on the primary
        self._waited = False  # a busy primary's Retry-After was waited out
        # The first server's own error response, if it refused before any byte went out.
        self.first_refusal: Refusal | None = None

    def new_leg(self) -> None:
        self.busy_wait = self._server_error = None

    async def refused(
        self, response: Response, upstream: Upstream, path: str, client: ClientStream,
        primary: Upstream, first_leg: bool,
    ) -> str | None:  # fmt: skip
        """A leg answered with another status than 200: why it failed (the answer goes on
        to another server), or None where the client has been given the refusal as is."""
        status, url = response.status, upstream.url
        if status in NOT_SERVED and upstream != primary:
            return f"{url} does not serve {path} (HTTP {status})"
        if client.started:
            # A continuation refused (a server that takes no partial answer says so with
            # a 4xx): its own words go into the reason.
            said = await response.read_all() if status < 500 else b""
            words = said[:200].decode(errors="replace").strip()
            return f"HTTP {status} from {url}" + (f": {words}" if words else "")
        refusal = (status, list(response.headers), await response.read_all(), response.reason)
        if (elsewhere := self.elsewhere(upstream, refusal)) is not None:
            # The client's own error, if no other server can answer: the first.
            self.first_refusal = self.first_refusal or refusal
            return elsewhere
        if status < 500:
            # The request itself was refused, by the first server or by one that was
            # asked it unchanged: the client gets the refusal as is.
            client.respond(*refusal)
            return None
        if first_leg:
            self.first_refusal = refusal  # for the client, if no other server can answer
        return f"HTTP {status} from {url}"

    def elsewhere(self, upstream: Upstream, refusal: Refusal) -> str | None:
        """Why this refusal sends the request on to another server, or None (the client
        gets it as it is)."""
        status, head, said, _ = refusal
        router, url = self._fleet.router, upstream.url
        if status >= 500 and status not in refusals.BUSY:
            self._server_error = status
        if status in refusals.BUSY:
            self.busy_wait = refusals.retry_after(head)
            busy_s = (
                refusals.BUSY_WITHOUT_RETRY_AFTER_S if self.busy_wait is None else self.busy_wait
            )
            router.mark_busy(url, busy_s, f"HTTP {status}")
            router.refused("busy")
            log.info("%s refused a request (HTTP %d): busy for %.3g s", url, status, busy_s)
            return f"HTTP {status} from {url}: busy for {busy_s:.3g} s"
        if refusals.out_of_context(status, said):
            servers = self._fleet.servers
            here = servers.get(upstream).slot_context
            for i, server in enumerate(self._ladder):
                there = servers.get(server).slot_context
                if here is not None and there is not None and there <= here:
                    self._rungs.failed.add(i)  # no more room there than here
            router.refused("out_of_context")
            log.info(
                "%s has no room for a prompt (HTTP %d): asking where there is more", url, status
            )
            return f"HTTP {status} from {url}: the prompt does not fit its context"
        return None

    def wait_for_primary(self, upstream: Upstream, started: bool) -> float | None:
        """How long to wait before asking the busy primary again, before any other
        server: exactly its Retry-After, once, where that is within the owner's budget
        (None: go on down the ladder)."""
        wait = self.busy_wait
        if started or wait is None or wait > self._fleet.busy_wait_s or self._waited:
            return None
        if upstream != self._ladder[0]:
            return None
        self._waited = True
        self._fleet.router.refused("waited")
        return wait

    def retry_soon(self, started: bool) -> float | None:
        """How long to wait before asking the busy server again, when nothing has gone
        out and it asked for a short wait (None: not again)."""
        wait = self.busy_wait
        if started or wait is None or wait > SHORT_WAIT_S or self._retries >= RETRIES:
            return None
        self._retries += 1
        self._fleet.router.refused("retried")
        return wait + random.uniform(0.05, 0.05 + wait / 4)

    async def ask_again_here(self, upstream: Upstream, started: bool) -> bool:
        """Whether the primary's server error is worth one more try there (see above)."""
        status, self._server_error = self._server_error, None
        fleet = self._fleet
        if status is None or started or self._asked_again or not fleet.retry_server_errors:
            return False
        if upstream != self._ladder[0] or fleet.router.state(upstream.url)[0] not in CALM:
            return False
        self._asked_again = True
        if not await fleet.router.answers_health(upstream.url):
            return False
        fleet.router.refused("asked_again")
        log.info(
            "%s failed a request (HTTP %d), answers /health: asked again", upstream.url, status
        )
        return True
