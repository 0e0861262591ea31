"""Where an answer may go next: its servers in order, the one carrying it, those that
failed it.

An asked-for handoff goes down the ladder, to servers that are up and not under memory
pressure (never onto the card that fired), those known to be fine first (a server whose
cards cannot be judged now comes after them). A failed leg goes down too, and failing that
back up to a server that was left while healthy (on request), and last to one under
pressure (it may yet survive; an error surely ends the answer): the ladder is not
one-way, but a server that failed an answer is never tried for it again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from addon.servers.routing import CALM
from addon.servers.upstream import Upstream


class Ladder:
    def __init__(
        self,
        servers: Sequence[Upstream],
        state: Callable[[str], str] = lambda _: "ok",
        admits: Callable[[Upstream], bool] = lambda _: True,
    ) -> None:
        """`state(url)`: the router's word for a server now (ok, pressured, down,
        draining); `admits(server)`: whether the client may be served there now (see
        Credentials.may_start_on)."""
        self.servers = list(servers)
        self.state = state
        self.admits = admits
        self.at = 0  # the index of the server carrying the answer now
        self.failed: set[int] = set()

    @property
    def current(self) -> Upstream:
        return self.servers[self.at]

    def below(self, *states: str) -> list[int]:
        """Where an asked-for handoff may go: down the ladder, past servers that failed,
        to those in `states` (default: ok, then unknown), in that order."""
        found = {state: [] for state in states or CALM}
        for i in range(self.at + 1, len(self.servers)):
            if i not in self.failed and self.admits(self.servers[i]):
                found.get(self.state(self.servers[i].url), []).append(i)
        return [i for rung in found.values() for i in rung]

    def after_failure(self) -> int | None:
        """The current server failed the answer: where it goes now, if anywhere."""
        self.failed.add(self.at)
        return self.would_go()

    def left(self) -> list[Upstream]:
        """The servers that have not failed the answer."""
        return [server for i, server in enumerate(self.servers) if i not in self.failed]

    def would_go(self) -> int | None:
        """Where the answer would go if the current server failed it now."""
        above = [i for i in range(self.at) if i not in self.failed and self.admits(self.servers[i])]
        return next(iter([*self.below(), *above, *self.below("pressured")]), None)
