"""Shadow prefill: the next server's cache already holds the answer when a handoff comes.

While an answer streams (on a server whose card is near a line, or always, as the owner
says), the next server down its ladder is sent the continuation as it stands, asking for
one token (`cache_prompt`): the slot llama-server runs it in then holds the prompt and the
answer so far, and a handoff's continuation computes only the tokens delivered since the
last update. Updates follow each other as fast as the server takes them once
`spillover_shadow_every` new tokens are there.

No request of a shadow's (nor the continuation after it) names a slot. llama-server gives
an unpinned request an idle slot only, the one whose cache shares the most with the
prompt: the slot of the last update while it is idle, another idle one if a client took
it. A pinned request, by contrast, reaches into a slot another answer is running in
(llama-server swaps that slot's cache before it defers the request), and no check made
before sending can rule that out. An update goes out only while the server lists an idle
slot (so it does not queue in front of clients' requests), and a continuation waits for
an update in flight on its server, so that it finds the slot that update filled.
A shadow never touches the answer itself: its requests go on their own client, a
failure only counts, and GIVE_UP_AFTER failures in a row end the shadow.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import httpx

from addon.formats.continuation import TOKEN_LIMIT_FIELDS
from addon.formats.dialect import Dialect
from addon.formats.shape import dumps
from addon.formats.transcript import Transcript
from addon.handoff.nextleg import NextLeg
from addon.servers.kept import KeptConnections
from addon.servers.slots import idle_slots
from addon.servers.upstream import Upstream

log = logging.getLogger(__name__)
POLL_S = 0.01  # how soon a shadow sees new tokens
BUSY_S = 0.1  # how soon a server with no idle slot is asked again
SLOTS_TIMEOUT_S = 2.0
PREFILL_TIMEOUT_S = 300.0  # the first update reads the whole prompt
GIVE_UP_AFTER = 3
KEPT_PER_SERVER = 2
# Fields that cost work and change nothing in the cache a prompt leaves behind (the
# continuation it is made from names no slot: NextLeg.continuation).
NOT_FOR_PREFILL = (
    *TOKEN_LIMIT_FIELDS, "stream_options", "logprobs", "top_logprobs", "n_probs",
    "post_sampling_probs", "timings_per_token", "return_tokens",
)  # fmt: skip
SHADOW_MODES = ("near", "always", "off")


def add_shadow_options(loader) -> None:
    loader.add_option(
        "spillover_shadow", str, "near",
        "Keep the next server's cache holding each answer so far, so a handoff needs no "
        "prefill: near (while the answer's card is near a line: see "
        "spillover_shadow_warn_mib), always, or off.",
        choices=SHADOW_MODES,
    )  # fmt: skip
    loader.add_option(
        "spillover_shadow_max", int, 1,
        "At most this many answers shadowed on each server at once.",
    )  # fmt: skip
    loader.add_option(
        "spillover_shadow_every", int, 32,
        "Update a shadow once this many new tokens are there: fewer leave less to read at "
        "a handoff, and cost the server a request (and one token) more often.",
    )  # fmt: skip


def prompt_only(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """A continuation request turned into a prefill of it (one token is the least
    llama-server generates), on whichever idle slot the server picks."""
    prefill = {k: v for k, v in body.items() if k not in NOT_FOR_PREFILL}
    limit = "n_predict" if path == "/completion" else "max_tokens"
    prefill.update({limit: 1, "stream": False, "cache_prompt": True})
    return prefill


class ShadowBudget:
    """How many answers are shadowed on each server, and the client their requests go on."""

    def __init__(self, headers: Callable[[str], dict[str, str]]) -> None:
        """`headers(url)`: what a request of the addon's own to that server carries."""
        self.shadowing: dict[str, int] = {}
        self.refused: dict[str, str] = {}  # server -> why the last shadow could not start
        self.limit = 1
        self.every = 32  # new tokens that make an update
        self._headers = headers
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            # On the legs' own connections (servers/kept.py): one a server closes is
            # closed here too, at once.
            self._client = httpx.AsyncClient(
                timeout=PREFILL_TIMEOUT_S, transport=KeptConnections(KEPT_PER_SERVER)
            )
        return self._client

    async def take(self, server: Upstream) -> bool:
        """Whether a shadow may start on `server` (`refused` says why not): it lists an
        idle slot, and fewer than the limit are shadowed there."""
        url = server.url
        try:
            idle = await self.has_idle_slot(url)
        except (httpx.HTTPError, ValueError) as exc:
            self.refused[url] = f"its slots cannot be listed ({_why(exc)}; --no-slots?)"
            return False
        count = self.shadowing.get(url, 0)
        if count >= self.limit:
            self.refused[url] = f"{count} shadowed already (spillover_shadow_max)"
            return False
        if not idle:
            self.refused[url] = "no free slot"
            return False
        self.refused.pop(url, None)
        self.shadowing[url] = count + 1
        return True

    def give_back(self, server: str) -> None:
        if (count := self.shadowing.get(server, 0) - 1) > 0:
            self.shadowing[server] = count
        else:
            self.shadowing.pop(server, None)

    async def has_idle_slot(self, server: str) -> bool:
        response = await self.client.get(
            f"{server}/slots", headers=self._headers(server), timeout=SLOTS_TIMEOUT_S
        )
        return bool(idle_slots(response.raise_for_status().json()))

    async def prefill(self, server: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = {**self._headers(server), "content-type": "application/json"}
        response = await self.client.post(f"{server}{path}", content=dumps(body), headers=headers)
        return response.raise_for_status().json()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def status(self) -> dict[str, Any]:
        return {"shadowing": dict(self.shadowing), "not_shadowed": dict(self.refused)}


class Shadow:
    """One answer's shadow on one server."""

    def __init__(
        self,
        leg: NextLeg,
        transcript: Transcript,
        target: Upstream,
        budget: ShadowBudget,
        moving: Callable[[], bool],
    ) -> None:
        """`moving()`: whether a handoff of the answer is being decided or made now."""
        self.target = target
        self.covered = 0  # answer tokens the server's cache holds (after the last update)
        self.updates = 0
        self.computed = 0  # prompt tokens the server computed for this shadow
        self.failures = 0
        self.busy = 0  # updates put off because the server had no idle slot
        self.last_ms: float | None = None
        self.ended: str | None = None
        # While a handoff of the answer is being decided, no update starts: one sent then
        # is still in flight at the cut, and the continuation waits for all of it.
        self._moving = moving
        self._leg = leg
        self._transcript = transcript
        self._budget = budget
        self._settled = asyncio.Event()  # no update in flight
        self._settled.set()
        self._task = asyncio.ensure_future(self._run())

    @property
    def gave_up(self) -> bool:
        return self.failures >= GIVE_UP_AFTER

    async def settled(self, server: Upstream) -> bool:
        """Once no update is in flight on `server` (see the module's docstring): whether
        the server's cache holds the answer so far from an update."""
        if server.url != self.target.url:
            return False
        await self._settled.wait()
        return self.updates > 0

    def stop(self, why: str) -> None:
        """No more updates; an update in flight finishes (a continuation may wait on it)."""
        if self.ended is None:
            self.ended = why
            self._budget.give_back(self.target.url)
            if self._settled.is_set():
                self._task.cancel()

    async def _run(self) -> None:
        while self.ended is None:
            produced = self._transcript.produced
            # From the first token on, so that every update takes the same path (token
            # ids where they can replay) and the first one's prefix is never read twice.
            every = self._budget.every
            pause = POLL_S
            due = produced and (self.updates == 0 or produced - self.covered >= every)
            if due and not self._moving():
                pause = await self._update(produced)
            if self.ended is None:
                await asyncio.sleep(pause)

    async def _update(self, produced: int) -> float:
        """One update, if the server has an idle slot: how long to wait before the next."""
        self._settled.clear()
        started = time.monotonic()
        try:
            if not await self._budget.has_idle_slot(self.target.url):
                self.busy += 1
                return BUSY_S
            path, body, _, _ = await self._leg.continuation(self.target)
            if self._moving():
                return POLL_S
            answer = await self._budget.prefill(self.target.url, path, prompt_only(path, body))
            self._leg.read_of(self.target, body, answer)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never the answer's trouble: only the shadow's
            self.failures += 1
            log.info("shadow prefill on %s failed: %s", self.target.url, _why(exc))
            if self.failures >= GIVE_UP_AFTER:
                self.stop(f"{self.failures} failures in a row, the last: {_why(exc)}")
            return POLL_S
        finally:
            self._settled.set()
        self.failures = 0
        self.updates += 1
        self.covered = produced
        self.last_ms = round((time.monotonic() - started) * 1000, 1)
        timings = answer.get("timings") if isinstance(answer, dict) else None
        if isinstance(timings, dict) and isinstance(timings.get("prompt_n"), int):
            self.computed += timings["prompt_n"]
        return POLL_S

    def status(self) -> dict[str, Any]:
        return {
            "server": self.target.url,
            "covered_tokens": self.covered,
            "updates": self.updates,
            "computed_tokens": self.computed,
            "last_update_ms": self.last_ms,
            "failures": self.failures,
            "put_off_busy": self.busy,
            "ended": self.ended,
        }


def _why(exc: BaseException) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    return type(exc).__name__


class LiveAnswer(Protocol):
    """What the shadows read of a live answer (a splice)."""

    streaming: bool
    moving: bool  # a handoff is being decided or made
    body: dict[str, Any]
    dialect: Dialect
    transcript: Transcript

    @property
    def current(self) -> Upstream: ...

    @property
    def next_leg(self) -> NextLeg: ...

    def next_server(self) -> Upstream | None: ...


class Shadows:
    """Which live answers are shadowed: started and stopped as their cards come near
    their lines and go, as the proxy ticks it."""

    def __init__(self, headers: Callable[[str], dict[str, str]]) -> None:
        self.budget = ShadowBudget(headers)
        self.by_answer: dict[str, Shadow] = {}
        # Whether a server's cards are near their lines (the memory watcher says).
        self.near: Callable[[str], bool] = lambda _: False
        self._starting: set[str] = set()
        self._gone: set[str] = set()  # answers that ended while their shadow was starting
        self._tasks: set[asyncio.Future[None]] = set()

    async def settled(self, answer: str, server: Upstream) -> bool:
        """Once no update of the answer's shadow is in flight on `server`: whether that
        server's cache holds the answer from one."""
        shadow = self.by_answer.get(answer)
        return shadow is not None and await shadow.settled(server)

    def tick(self, answer: str, splice: LiveAnswer, mode: str) -> None:
        shadow = self.by_answer.get(answer)
        wanted = (
            splice.streaming
            and splice.dialect.shadowed
            and splice.body.get("cache_prompt") is not False
            and (mode == "always" or (mode == "near" and self.near(splice.current.url)))
        )
        target = splice.next_server() if wanted else None
        if shadow is not None and shadow.ended is None:
            if target is None or target != shadow.target:
                shadow.stop("no longer wanted there")
            return
        if shadow is not None and shadow.gave_up:
            return  # one answer's shadow that keeps failing is not started again
        if target is not None and answer not in self._starting:
            self._starting.add(answer)
            task = asyncio.ensure_future(self._start(answer, splice, target))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _start(self, answer: str, splice: LiveAnswer, target: Upstream) -> None:
        try:
            if not await self.budget.take(target):
                return
            if answer in self._gone:
                self.budget.give_back(target.url)
                return
            self.by_answer[answer] = Shadow(
                splice.next_leg, splice.transcript, target, self.budget, lambda: splice.moving
            )
        finally:
            self._starting.discard(answer)
            self._gone.discard(answer)

    def handed_off(self, answer: str) -> None:
        if (shadow := self.by_answer.get(answer)) is not None:
            shadow.stop("handed off")

    def ended(self, answer: str) -> None:
        if answer in self._starting:
            self._gone.add(answer)
        if (shadow := self.by_answer.pop(answer, None)) is not None:
            shadow.stop("the answer ended")

    async def close(self) -> None:
        for answer in list(self.by_answer):
            self.ended(answer)
        await self.budget.close()
