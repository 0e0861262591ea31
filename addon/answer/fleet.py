"""What a live answer may ask of the servers behind the proxy, as one object.

A `Fleet` holds what the proxy keeps about its servers (their properties, their states
and the routes new answers take, the keys for each, the shadows and migrations under
way) and the owner's settings a splice follows. A `Route` is where one answer may go,
decided when it starts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from addon.answer.declines import Declines
from addon.answer.pace import FirstEvents, PaceLimits
from addon.formats.continuers import OWN_RENDERING, TRAILING_MESSAGE
from addon.handoff import translated
from addon.handoff.migration import Migrator
from addon.handoff.shadow import Shadows
from addon.servers.credentials import Credentials
from addon.servers.directory import ServerDirectory
from addon.servers.engines import RENDERS_ON_ASKING
from addon.servers.exchange import Exchange
from addon.servers.routing import Router
from addon.servers.upstream import Upstream

COMPARED = ("chat", *translated.CHECKED)  # APIs whose continuations are compared per answer


@dataclass(frozen=True)
class Route:
    ladder: list[Upstream]  # the servers the answer may use, the one it starts on first
    primary: Upstream  # the server the client addressed
    note: str | None = None  # why it does not start on the primary, told to the client
    locked: frozenset[str] = frozenset()  # servers that want a key the addon was not given


class Fleet:
    def __init__(self, on_question: Callable[[Exchange], None] = lambda _: None) -> None:
        self.fallbacks: list[Upstream] = []
        self.servers = ServerDirectory(on_exchange=on_question)
        self.router = Router(on_back=self.servers.back)
        self.credentials = Credentials()
        self.shadows = Shadows(self.question_headers)
        self.migrator = Migrator(None, headers=self.question_headers)
        self.exact = True  # token-exact replay where the servers share a tokenizer
        self.pace = PaceLimits()
        self.first_events = FirstEvents()  # how long each server takes to its first event
        self.retry_server_errors = True  # a primary's 5xx is asked once more (answer/early.py)
        self.busy_wait_s = 3.0  # a busy primary's Retry-After waited out up to this
        self.declines = Declines()  # handoffs not made: no server could go on with the answer

    def question_headers(self, url: str) -> dict[str, str]:
        return self.credentials.question_headers(url)

    def use_credentials(self, credentials: Credentials) -> None:
        self.credentials = self.servers.credentials = credentials

    def use_fallbacks(self, urls: Sequence[str], running: bool) -> None:
        cleaned = (u.strip().rstrip("/") for u in urls)
        self.fallbacks = [Upstream(u) for u in cleaned if u]
        if running:
            self.servers.learn(self.fallbacks, fallbacks=True)

    def use_slot_dir(self, directory: str, primaries: Sequence[Upstream] | None) -> None:
        """Migrate through `directory` (empty: never); `primaries`, once running: the
        servers to ask again whether migration can reach them."""
        self.servers.slot_dir = self.migrator.directory = Path(directory) if directory else None
        if directory and primaries is not None:
            self.servers.learn([*primaries, *self.fallbacks])

    def route(self, primary: Upstream, bound: int | None) -> Route:
        """Where a new answer of at most `bound` tokens (None: unknown) may go, for a
        client that addressed `primary`."""
        # Known from start-up, unless it is not the proxy target or was not up then.
        self.servers.learn([primary])
        self.servers.learn(self.fallbacks, fallbacks=True)
        locked = self.servers.wanting_keys()

        def may_start(server: Upstream) -> bool:
            context = self.servers.get(server).slot_context
            fits = context is None or bound is None or bound <= context
            return server == primary or (
                fits and self.credentials.may_start_on(server.url, primary.url, locked)
            )

        ladder, note = self.router.plan([primary, *self.fallbacks], may_start)
        return Route(ladder, primary, note, locked)

    def state(self, url: str) -> str:
        return self.router.state(url)[0]

    def continues(self, server: Upstream, dialect: str, spaced: bool = False) -> bool:
        """Whether `server` is proven to continue a partial assistant message sent in
        `dialect`'s API (`spaced`: one that ends in whitespace). A way of asking other than
        the message alone (continue_final_message, a rendered prompt) is chat's, proven on
        chat: another API's request cannot take it."""
        info = self.servers.get(server)
        # A chat, Messages or Responses answer's prompt is compared with the truth on
        # llama-server each time (handoff/builder.py, handoff/translated.py): there a
        # trailing message that the start-up proof found rendered otherwise is tried, and
        # refused in-band where this answer's prompt parts from the truth.
        checked = (
            dialect in COMPARED and info.engine in RENDERS_ON_ASKING and info.proof == "engine"
        )
        by_message = info.continues_by == TRAILING_MESSAGE.name or (
            info.continues_by == OWN_RENDERING.name and checked
        )
        return (
            info.continues is True
            and (by_message or dialect == "chat")
            and not (spaced and info.trims_whitespace and not checked)
        )

    def unproven(
        self,
        ladder: Sequence[Upstream],
        admits: Callable[[Upstream], bool],
        dialect: str,
        spaced: bool = False,
    ) -> str:
        """Why servers of `ladder` that `admits` turns away for want of proof continue
        nothing in `dialect`'s API ("" when there are none), for the client's error."""
        whys = []
        for server in ladder:
            if admits(server) or self.continues(server, dialect, spaced):
                continue
            info = self.servers.get(server)
            why = info.continues_why
            if info.continues and spaced and info.trims_whitespace:
                why = "it drops the trailing whitespace the answer so far ends with"
            elif info.continues:
                why = f"it continues chat answers only, by {info.continues_by}"
            whys.append(f"{server.url} ({why})")
        return f"; not proven to continue an answer: {', '.join(whys)}" if whys else ""

    def mark_down(self, server: Upstream, why: str) -> None:
        self.router.mark_down(server.url, why)

    @property
    def migrating(self) -> Migrator | None:
        """The migrator, where the owner named a slot directory."""
        return self.migrator if self.migrator.directory is not None else None

    def ended(self, answer: str, reads: Sequence[tuple[str, int, float]] = ()) -> None:
        """An answer is over: its shadow stops; its legs' prompt readings teach the
        migrator how fast each server reads."""
        self.shadows.ended(answer)
        if reads:
            self.migrator.rates.learn(list(reads))

    async def close(self) -> None:
        await self.shadows.close()
        await self.migrator.close()
        await self.servers.close()
