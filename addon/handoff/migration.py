"""KV migration: an answer moves to a server running the same model with its KV state,
instead of that server reading the prompt and the answer so far again.

When the splice has cut the source's leg (at a token boundary: the delivered tokens), the
migrator finds the source's slot that holds the answer (idle, holding the prompt and the
delivered tokens, give or take the few it wrote after the last delivered one), saves it
into the directory both servers save slots in (`--slot-save-path`), restores it into a
free slot of the target. The continuation goes on from the exact token ids and names no
slot: llama-server's own choice among idle slots (the one whose cache shares the most
with the prompt) finds the restored one, unless a client took it meanwhile (a pinned
request would reach into that client's answer: see shadow.py). It reuses the restored
cache as far as it matches the ids and reads only the rest: a wrong, stale or taken slot
costs time, never the text. Each step can fail, and the caller can be cancelled at any
point (the steps then end on their own); the file is always removed and a slot that was
not used is given back, and the continuation then replays as it would have.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from addon.handoff.record import Moved
from addon.handoff.slotlocks import SlotLocks
from addon.servers.fingerprint import Fingerprint
from addon.servers.kept import KeptConnections
from addon.servers.slots import idle_slots, unused_first
from addon.servers.upstream import Upstream

if TYPE_CHECKING:
    from addon.handoff.nextleg import NextLeg
    from addon.handoff.record import Handoff
    from addon.servers.directory import ServerDirectory

log = logging.getLogger(__name__)
MIN_TOKENS = 64  # until both are measured: below this, reading again is about as quick
MEASURED_FROM = 32  # a prompt reading of fewer tokens says little about the reading rate
SMOOTHING = 0.3  # weight of the newest measurement
# Tokens a cut source may write after the last one delivered before it notices the cut
# (about 30 ms on llama-server, whatever its token rate). A slot picked wrongly costs time,
# never text: the continuation reuses only what matches its token ids.
WRITTEN_AFTER = 256
FIND_S = 1.0  # how long the cut source's slot is looked for (it goes idle within a step)
SLOTS_TIMEOUT_S = 2.0
MOVE_TIMEOUT_S = 60.0  # saving or restoring a long context of a big model
KEPT_PER_SERVER = 2


def add_migration_options(loader) -> None:
    loader.add_option(
        "spillover_slot_dir", str, "",
        "A directory every server saves its slots in (each run with --slot-save-path set "
        "to it): an answer handed off to a server that runs the same model (same "
        "fingerprint) then moves its KV state there instead of being read again. Each "
        "server is fingerprinted at start: one probe completion (one token, not cached) "
        "and one slot save.",
    )  # fmt: skip


class MigrationFailed(Exception):
    pass


@dataclass
class Rates:
    """What reading tokens and moving them has cost on each server, as measured; the
    expected pauses decide between migration and replay."""

    read_ms: dict[str, float] = field(default_factory=dict)  # per token read
    move_ms: dict[str, float] = field(default_factory=dict)  # per token saved and restored
    move_fixed_ms: dict[str, float] = field(default_factory=dict)  # the rest of a move

    def learn(self, reads: list[tuple[str, int, float]]) -> None:
        """Prompt readings as servers timed them: (server, tokens, ms)."""
        for server, tokens, ms in reads:
            if tokens >= MEASURED_FROM:
                _mix(self.read_ms, server, ms / tokens)

    def moved(self, target: str, moved: Moved) -> None:
        if moved.save_ms is None or moved.restore_ms is None or moved.took_ms is None:
            return
        _mix(self.move_ms, target, (moved.save_ms + moved.restore_ms) / max(1, moved.tokens))
        _mix(self.move_fixed_ms, target, moved.took_ms - moved.save_ms - moved.restore_ms)

    def expected(self, target: str, tokens: int) -> tuple[float, float] | None:
        """(moving, reading) `tokens` onto `target`, in ms, once both are measured."""
        if target not in self.read_ms or target not in self.move_ms:
            return None
        move = self.move_fixed_ms[target] + self.move_ms[target] * tokens
        return move, self.read_ms[target] * tokens

    def status(self) -> dict[str, Any]:
        return {
            "read_ms_per_token": _rounded(self.read_ms),
            "move_ms_per_token": _rounded(self.move_ms),
            "move_fixed_ms": _rounded(self.move_fixed_ms),
        }


def _mix(rates: dict[str, float], key: str, value: float) -> None:
    rates[key] = value if key not in rates else (1 - SMOOTHING) * rates[key] + SMOOTHING * value


def _rounded(rates: dict[str, float]) -> dict[str, float]:
    return {key: round(value, 4) for key, value in rates.items()}


@dataclass
class Migrator:
    directory: Path | None  # where both servers save slots; None: no migration
    headers: Callable[[str], dict[str, str]] = lambda _: {}
    last: Moved | None = None  # the last migration tried
    rates: Rates = field(default_factory=Rates)
    _client: httpx.AsyncClient | None = None
    _moving: set[asyncio.Future[Moved]] = field(default_factory=set)
    _files: set[str] = field(default_factory=set)  # made by moves, not removed yet
    _locks: SlotLocks | None = None
    # Servers that read a restored answer again (their cache cannot keep a restored state:
    # sliding-window, hybrid or recurrent models, or a restore that did nothing): why.
    rereads: dict[str, str] = field(default_factory=dict)

    @property
    def locks(self) -> SlotLocks:
        """The slots restored and not used yet, held in the slot directory (so that
        workers sharing it never restore into one another's)."""
        assert self.directory is not None
        if self._locks is None or self._locks.directory.parent != self.directory:
            if self._locks is not None:  # the owner named another directory meanwhile
                self._locks.release_all()
            self._locks = SlotLocks(self.directory)
        return self._locks

    @property
    def reserved(self) -> dict[str, set[int]]:
        if self._locks is None:
            return {}
        return {url: set(slots) for url, slots in self._locks.held().items()}

    async def for_handoff(
        self, next_leg: NextLeg, servers: ServerDirectory, target: Upstream, handoff: Handoff
    ) -> int | None:
        """Move the answer's state to `target` when it should (see `why_not`): the
        target's slot that holds it, or None to replay. The handoff records the outcome."""
        source = Upstream(handoff.source)
        holds = await next_leg.tokens_held(source, target)
        if holds is None:
            why = "the answer is not replayed as token ids"
        else:
            why = self.why_not(
                servers.get(source).fingerprint, servers.get(target).fingerprint, holds,
                target.url,
            )  # fmt: skip
        if why is not None:
            handoff.migration = Moved(why=f"not moved: {why}", tokens=holds or 0)
            return None
        assert holds is not None
        handoff.migration = await self.move(source, target, holds)
        return handoff.migration.slot

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            # On the legs' own connections (see shadow.py).
            self._client = httpx.AsyncClient(
                timeout=MOVE_TIMEOUT_S, transport=KeptConnections(KEPT_PER_SERVER)
            )
        return self._client

    async def close(self) -> None:
        """Let moves under way end (as long as one may take), remove what they left."""
        if self._moving:
            await asyncio.wait(set(self._moving), timeout=MOVE_TIMEOUT_S)
        if self.directory is not None:
            for name in list(self._files):
                self._remove(name)
        if self._locks is not None:
            self._locks.release_all()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def why_not(
        self,
        source: Fingerprint | str | None,
        target: Fingerprint | str | None,
        tokens: int,
        target_url: str,
    ) -> str | None:
        """Why `tokens` should not migrate between servers with these fingerprints (or
        why they have none) onto `target_url`, or None if they should: when reading them
        again is expected to be quicker, as measured (before that: when they are few)."""
        if (reread := self.rereads.get(target_url)) is not None:
            return reread
        for name, print_ in (("source", source), ("target", target)):
            if not isinstance(print_, Fingerprint):
                return f"the {name} has no fingerprint ({print_ or 'not taken yet'})"
        assert isinstance(source, Fingerprint) and isinstance(target, Fingerprint)
        if differ := source.differences(target):
            return f"their fingerprints differ in {', '.join(differ)}"
        if (expected := self.rates.expected(target_url, tokens)) is not None:
            move, read = expected
            if read <= move:
                return (
                    f"reading {tokens} tokens again is expected to take {read:.0f} ms, "
                    f"moving them {move:.0f} ms"
                )
        elif tokens < MIN_TOKENS:
            return f"only {tokens} tokens: reading them again is as quick"
        return None

    def judge(self, target: str, moved: Moved, timings: dict[str, Any]) -> None:
        """Say what a restore into `target` saved, from the continuation's first timings
        (llama-server's `cache_n`: tokens taken from the cache, `prompt_n`: read); a
        target that read it again gets no migration from then on."""
        cached, read = timings.get("cache_n"), timings.get("prompt_n")
        if not isinstance(cached, int) or not isinstance(read, int):
            return
        moved.reused, moved.read = cached, read
        if not moved.read_again:
            moved.why = f"moved {moved.tokens} tokens' KV state"
            return
        moved.why = (
            f"restored {moved.tokens} tokens' KV state, but the server read them again "
            "(no more migrations there)"
        )
        self.rereads[target] = (
            f"its last restore was read again ({read} tokens read, {cached} reused: its "
            "cache does not keep a restored state)"
        )
        log.warning("%s read a restored answer again: %s", target, self.rereads[target])

    def status(self) -> dict[str, Any]:
        return {
            "directory": str(self.directory) if self.directory else None,
            "read_again_on": dict(self.rereads),
            "reserved": self._locks.held() if self._locks else {},
            "last": self.last.as_metadata() if self.last else None,
            "rates": self.rates.status(),
        }

    def release(self, target: str, slot: int) -> None:
        """The continuation took (or will never take) the restored slot."""
        if self._locks is not None:
            self._locks.release(target, slot)

    async def move(self, source: Upstream, target: Upstream, holds: int) -> Moved:
        """Move the cut answer's state (`holds` tokens: prompt and delivered answer) from
        `source` to a free slot of `target`. Never raises for a failed step: the outcome
        says what happened. The steps run on their own: a caller cancelled meanwhile
        leaves them to end (a server writes a file it was asked to save whatever happens
        to the request), and what they made is then removed and released."""
        assert self.directory is not None
        abandoned = asyncio.Event()
        steps = asyncio.ensure_future(self._move(source, target, holds, abandoned))
        self._moving.add(steps)
        steps.add_done_callback(self._moving.discard)
        try:
            return await asyncio.shield(steps)
        except asyncio.CancelledError:
            abandoned.set()
            if steps.done() and (slot := steps.result().slot) is not None:
                self.release(target.url, slot)  # it ended as the caller was cancelled
            raise

    async def _move(
        self, source: Upstream, target: Upstream, holds: int, abandoned: asyncio.Event
    ) -> Moved:
        assert self.directory is not None
        started = time.monotonic()
        moved = Moved(tokens=holds)
        name = f"spillover-{secrets.token_hex(8)}.bin"
        self._files.add(name)
        slot = None
        try:
            found = await self._source_slot(source, holds)
            moved.find_ms = round((time.monotonic() - started) * 1000, 1)
            if abandoned.is_set():
                raise MigrationFailed("abandoned")
            saved = await self._post(source, f"/slots/{found}?action=save", name)
            moved.save_ms = _ms(saved, "save_ms")
            moved.size = int(saved.get("n_written") or 0)
            if int(saved.get("n_saved") or 0) < holds - 1:
                raise MigrationFailed(f"the source's slot held {saved.get('n_saved')} tokens")
            if abandoned.is_set():
                raise MigrationFailed("abandoned")
            slot = await self._free_slot(target)
            restored = await self._post(target, f"/slots/{slot}?action=restore", name)
            moved.restore_ms = _ms(restored, "restore_ms")
            if int(restored.get("n_restored") or 0) < holds - 1:
                raise MigrationFailed(f"the target restored {restored.get('n_restored')} tokens")
            # Whether the target uses it is known only from the continuation's first token.
            moved.slot, moved.why = slot, f"restored {holds} tokens' KV state"
        except (MigrationFailed, httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            moved.why = f"migration failed: {_why(exc)}"
        finally:
            self._remove(name)
            if slot is not None and (moved.slot is None or abandoned.is_set()):
                self.release(target.url, slot)
                moved.slot = None
            moved.took_ms = round((time.monotonic() - started) * 1000, 1)
            self.last = moved
        if moved.slot is not None:
            self.rates.moved(target.url, moved)
        return moved

    def _remove(self, name: str) -> None:
        assert self.directory is not None
        (self.directory / name).unlink(missing_ok=True)
        self._files.discard(name)

    async def _source_slot(self, source: Upstream, holds: int) -> int:
        """The idle slot of the cut source that holds the answer: the most recent task
        whose cache is the prompt and the delivered tokens (and the few written after)."""
        deadline = time.monotonic() + FIND_S
        while True:
            slots = await self._slots(source)
            fits = [
                s for s in idle_slots(slots)
                if holds - 1 <= int(s.get("n_prompt_tokens") or -1) <= holds + WRITTEN_AFTER
            ]  # fmt: skip
            if fits:
                return int(max(fits, key=lambda s: int(s.get("id_task") or 0))["id"])
            if time.monotonic() > deadline:
                raise MigrationFailed("no idle slot of the source holds the answer")
            await asyncio.sleep(0.005)

    async def _free_slot(self, target: Upstream) -> int:
        """An idle slot of the target, an unused one first, that no proxy has reserved;
        reserved until released."""
        for slot in unused_first(idle_slots(await self._slots(target))):
            if self.locks.take(target.url, int(slot["id"])):
                return int(slot["id"])
        raise MigrationFailed("the target has no free slot")

    async def _slots(self, server: Upstream) -> list[dict[str, Any]]:
        response = await self.client.get(
            f"{server.url}/slots", headers=self.headers(server.url), timeout=SLOTS_TIMEOUT_S
        )
        slots = response.raise_for_status().json()
        if not isinstance(slots, list):
            raise ValueError("its /slots is not a list")
        return slots

    async def _post(self, server: Upstream, path: str, filename: str) -> dict[str, Any]:
        response = await self.client.post(
            f"{server.url}{path}", json={"filename": filename}, headers=self.headers(server.url)
        )
        answer = response.raise_for_status().json()
        if not isinstance(answer, dict):
            raise ValueError(f"{path} answered {answer!r:.100}")
        return answer


def _ms(answer: dict[str, Any], key: str) -> float | None:
    timings = answer.get("timings")
    value = timings.get(key) if isinstance(timings, dict) else None
    return round(float(value), 2) if isinstance(value, int | float) else None


def _why(exc: BaseException) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code} from {exc.request.url.path}"
    return str(exc) or type(exc).__name__
