"""Where an answer may go next: its servers in order, the one carrying it, those that
failed it.

An asked-for handoff goes down the ladder. A failed leg goes down too, and failing that
back up to a server that was left while healthy (on request): the ladder is not one-way,
but a server that failed an answer is never tried for it again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from addon.upstream import Upstream


class Ladder:
    def __init__(
        self, servers: Sequence[Upstream], usable: Callable[[str], bool] = lambda _: True
    ) -> None:
        """`usable(url)`: whether a handoff may go there now (not down, not draining)."""
        self.servers = list(servers)
        self.usable = usable
        self.at = 0  # the index of the server carrying the answer now
        self.failed: set[int] = set()

    @property
    def current(self) -> Upstream:
        return self.servers[self.at]

    def below(self) -> list[int]:
        """Where an asked-for handoff may go: down the ladder, past servers that failed."""
        return [
            i
            for i in range(self.at + 1, len(self.servers))
            if i not in self.failed and self.usable(self.servers[i].url)
        ]

    def after_failure(self) -> int | None:
        """The current server failed the answer: where it goes now, if anywhere."""
        self.failed.add(self.at)
        above = [i for i in range(self.at) if i not in self.failed]
        return next(iter([*self.below(), *above]), None)
