"""Shadow prefill: the next server's cache already holds the answer when a handoff comes.

While an answer streams (on a server whose card is near a line, or always, as the owner
says), the next server down its ladder is sent the continuation as it stands, asking for
one token, on a slot the shadow keeps (`id_slot`, `cache_prompt`): that slot's KV cache
then holds the prompt and the answer so far, and a handoff's continuation computes only
the tokens delivered since the last update. Updates follow each other as fast as the
server takes them once `spillover_shadow_every` new tokens are there.

A continuation is pinned to the shadow's slot only while an update is in flight on it
(it then waits for that update and reuses it); otherwise llama-server's own slot choice
(the idle slot whose cache shares the most with the prompt) finds the slot if it is still
ours, and another slot if another client took it meanwhile, so a handoff never waits on
a stranger's request. A shadow never touches the answer itself: its requests go on their
own client, a failure only counts, and GIVE_UP_AFTER failures in a row end the shadow.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx

from addon.continuation import TOKEN_LIMIT_FIELDS, Transcript
from addon.nextleg import NextLeg
from addon.slots import idle_slots
from addon.upstream import Upstream

if TYPE_CHECKING:
    from addon.splice import Splice

log = logging.getLogger(__name__)
POLL_S = 0.01  # how soon a shadow sees new tokens
SLOTS_TIMEOUT_S = 2.0
PREFILL_TIMEOUT_S = 300.0  # the first update reads the whole prompt
GIVE_UP_AFTER = 3
# Fields that cost work and change nothing in the cache a prompt leaves behind.
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


def prompt_only(path: str, body: dict[str, Any], slot: int) -> dict[str, Any]:
    """A continuation request turned into a prefill of it on `slot` (one token is the
    least llama-server generates)."""
    prefill = {k: v for k, v in body.items() if k not in NOT_FOR_PREFILL}
    limit = "n_predict" if path == "/completion" else "max_tokens"
    prefill.update({limit: 1, "stream": False, "id_slot": slot, "cache_prompt": True})
    return prefill


class ShadowSlots:
    """The slots shadows hold on each server, and the client their requests go on."""

    def __init__(self, headers: Callable[[str], dict[str, str]]) -> None:
        """`headers(url)`: what a request of the addon's own to that server carries."""
        self.held: dict[str, set[int]] = {}
        self.refused: dict[str, str] = {}  # server -> why the last shadow could not start
        self.limit = 1
        self.every = 32  # new tokens that make an update
        self._headers = headers
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=PREFILL_TIMEOUT_S)
        return self._client

    async def take(self, server: Upstream) -> int | None:
        """A free slot of `server` for a shadow, or None (`refused` says why)."""
        url, held = server.url, self.held.setdefault(server.url, set())
        if len(held) >= self.limit:
            self.refused[url] = f"{len(held)} shadowed already (spillover_shadow_max)"
            return None
        try:
            response = await self.client.get(
                f"{url}/slots", headers=self._headers(url), timeout=SLOTS_TIMEOUT_S
            )
            slots = response.raise_for_status().json()
        except (httpx.HTTPError, ValueError) as exc:
            self.refused[url] = f"its slots cannot be listed ({_why(exc)}; --no-slots?)"
            return None
        idle = [s["id"] for s in idle_slots(slots, held)]
        if not idle:
            self.refused[url] = "no free slot"
            return None
        self.refused.pop(url, None)
        held.add(idle[-1])
        return idle[-1]

    def give_back(self, server: str, slot: int) -> None:
        self.held.get(server, set()).discard(slot)

    async def prefill(self, server: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self.client.post(
            f"{server}{path}", json=body, headers=self._headers(server)
        )
        return response.raise_for_status().json()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def status(self) -> dict[str, Any]:
        return {
            "held": {url: sorted(slots) for url, slots in self.held.items() if slots},
            "not_shadowed": dict(self.refused),
        }


class Shadow:
    """One answer's shadow on one server's slot."""

    def __init__(
        self, leg: NextLeg, transcript: Transcript, target: Upstream, slot: int, slots: ShadowSlots
    ) -> None:
        self.target = target
        self.slot = slot
        self.covered = 0  # answer tokens the slot holds (after the last update)
        self.updates = 0
        self.computed = 0  # prompt tokens the server computed for this shadow
        self.failures = 0
        self.last_ms: float | None = None
        self.ended: str | None = None
        self._leg = leg
        self._transcript = transcript
        self._slots = slots
        self._in_flight = False
        self._task = asyncio.ensure_future(self._run())

    @property
    def gave_up(self) -> bool:
        return self.failures >= GIVE_UP_AFTER

    def slot_for(self, server: Upstream) -> int | None:
        """The slot a continuation on `server` should be pinned to: only while an update
        is in flight there (see the module's docstring)."""
        return self.slot if self._in_flight and server.url == self.target.url else None

    def stop(self, why: str) -> None:
        """No more updates; an update in flight finishes (a continuation may wait on it)."""
        if self.ended is None:
            self.ended = why
            self._slots.give_back(self.target.url, self.slot)
            if not self._in_flight:
                self._task.cancel()

    async def _run(self) -> None:
        while self.ended is None:
            self._transcript.settle()
            produced = self._transcript.produced
            # From the first token on, so that every update takes the same path (token
            # ids where they can replay) and the first one's prefix is never read twice.
            every = self._slots.every
            if produced and (self.updates == 0 or produced - self.covered >= every):
                await self._update(produced)
            if self.ended is None:
                await asyncio.sleep(POLL_S)

    async def _update(self, produced: int) -> None:
        self._in_flight = True
        started = time.monotonic()
        try:
            path, body, _, _ = await self._leg.continuation(self.target)
            answer = await self._slots.prefill(
                self.target.url, path, prompt_only(path, body, self.slot)
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never the answer's trouble: only the shadow's
            self.failures += 1
            log.info("shadow prefill on %s failed: %s", self.target.url, _why(exc))
            if self.failures >= GIVE_UP_AFTER:
                self.stop(f"{self.failures} failures in a row, the last: {_why(exc)}")
            return
        finally:
            self._in_flight = False
        self.failures = 0
        self.updates += 1
        self.covered = produced
        self.last_ms = round((time.monotonic() - started) * 1000, 1)
        timings = answer.get("timings") if isinstance(answer, dict) else None
        if isinstance(timings, dict) and isinstance(timings.get("prompt_n"), int):
            self.computed += timings["prompt_n"]

    def status(self) -> dict[str, Any]:
        return {
            "server": self.target.url,
            "slot": self.slot,
            "covered_tokens": self.covered,
            "updates": self.updates,
            "computed_tokens": self.computed,
            "last_update_ms": self.last_ms,
            "failures": self.failures,
            "ended": self.ended,
        }


def _why(exc: BaseException) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    return type(exc).__name__


class Shadows:
    """Which live answers are shadowed: started and stopped as their cards come near
    their lines and go, as the proxy ticks it."""

    def __init__(self, headers: Callable[[str], dict[str, str]]) -> None:
        self.slots = ShadowSlots(headers)
        self.by_answer: dict[str, Shadow] = {}
        # Whether a server's cards are near their lines (the memory watcher says).
        self.near: Callable[[str], bool] = lambda _: False
        self._starting: set[str] = set()
        self._gone: set[str] = set()  # answers that ended while their shadow was starting
        self._tasks: set[asyncio.Future[None]] = set()

    def slot_for(self, answer: str, server: Upstream) -> int | None:
        shadow = self.by_answer.get(answer)
        return shadow.slot_for(server) if shadow is not None else None

    def tick(self, answer: str, splice: Splice, mode: str) -> None:
        shadow = self.by_answer.get(answer)
        wanted = (
            splice.streaming
            and splice.dialect.pins_slots
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

    async def _start(self, answer: str, splice: Splice, target: Upstream) -> None:
        try:
            slot = await self.slots.take(target)
            if slot is None:
                return
            if answer in self._gone:
                self.slots.give_back(target.url, slot)
                return
            self.by_answer[answer] = Shadow(
                splice.next_leg, splice.transcript, target, slot, self.slots
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
        await self.slots.close()
