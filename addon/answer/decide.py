"""Whether an answer that is going well may be cut: a pressure, slow or asked handoff
(and a hand-back) first decides that some server it could go to may go on with it.

Every refusal the continuation can meet is decided from what is known before the cut:
the answer's own (its dialect's: bound by a grammar, a whole tool call sent), then each
target's (handoff/known.py: reasoning, token ids of another vocabulary, sampling the
next engine lacks; the dialect's own leg), and, while the leg goes on, what the target
must be asked (its renderings and tokens, which refuse pictures it cannot take or text
that spells its special tokens: the continuation built as the answer stands) and
whether the rest fits there. The leg is cut only for a target that passes; where none
does, the answer stays where it is, and why is logged and kept for the status. The same
checks run again at the moment of use, on the answer as it stands then: what the model
wrote meanwhile may still be refused there, which ends the answer as a failure with
nowhere to go would.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from addon.answer.fleet import Fleet
from addon.handoff.nextleg import NextLeg
from addon.servers.upstream import Upstream

REPEATED = frozenset({"slow", "handback"})  # asked again at each look while they hold
QUIET_S = 2.0  # how long a repeated kind, once declined, is not decided again
NONE_BELOW = "no other server is up, clear of pressure and proven to continue it"
log = logging.getLogger(__name__)


class Decision:
    """Where one answer may be cut to, decided before its leg is dropped."""

    def __init__(
        self,
        next_leg: NextLeg,
        ladder: Sequence[Upstream],
        admits: Callable[[Upstream], bool],
        spaced: Callable[[], bool],
        fleet: Fleet,
        answer: str,
    ) -> None:
        """`admits(server)`: whether the answer may go on there now; `spaced()`: whether
        it ends in whitespace (see Fleet.unproven); `answer`: its name (the flow's id)."""
        self._next = next_leg
        self._ladder = ladder
        self._admits = admits
        self._spaced = spaced
        self._fleet = fleet
        self._answer = answer
        self._quiet: dict[str, tuple[float, str]] = {}  # a repeated kind: (until, why said)
        # The decision under way: its targets in order, and why each refused may not go
        # on with the answer (None: why none may).
        self._targets: list[int] = []
        self._refused: dict[int | None, str] = {}

    def quiet(self, kind: str) -> bool:
        """Whether `kind` was declined a moment ago and is not decided again yet."""
        return kind in self._quiet and time.monotonic() < self._quiet[kind][0]

    def known(self, targets: Sequence[int]) -> list[int]:
        """Begin a decision among `targets` (ladder indices): those nothing known turns
        away."""
        self._targets, self._refused = list(targets), {}
        nextleg = self._next
        answer = nextleg.dialect.cannot_continue(nextleg.body, nextleg.transcript)
        if answer is not None:
            self._refused[None] = answer
            return []
        for index in targets:
            if (why := self._refusal(self._ladder[index])) is not None:
                self._refused[index] = why
        return [index for index in targets if index not in self._refused]

    def at_once(self, index: int) -> bool:
        """Whether the answer may be cut to `index` with nothing asked: nothing has gone
        out (any server answers it from the start), and the rest surely fits there."""
        return not self._next.said and self._next.fits_without_asking(self._ladder[index])

    async def asked(self, targets: Sequence[int]) -> int | None:
        """The first of `targets` that its own answers let go on with the answer and
        that has room for the rest; None where there is none."""
        for index in targets:
            server = self._ladder[index]
            if self._next.said:  # its continuation built, and the room it takes asked
                why = await self._asked_refusal(server)
            elif not await self._next.fits(server):
                why = f"{server.url} has no room for the rest of this answer"
            else:
                why = None
            # Decided again as the answer stands now: text may have gone out meanwhile.
            if why is None and (why := self._refusal(server)) is None:
                return index
            self._refused[index] = why
        return None

    def passed_by(self, target: int) -> str | None:
        """Once, why the servers before `target`, the one the decision chose, may not go
        on with the answer (None: none was passed by, or no decision chose it)."""
        targets, self._targets = self._targets, []
        before = targets[: targets.index(target)] if target in targets else []
        return "; ".join(self._refused[i] for i in before if i in self._refused) or None

    def declined(self, kind: str, server: str) -> None:
        """The decision chose nothing: say why a handoff of `kind` off `server` was not
        made, and the answer stays."""
        who = "the primary may not" if kind == "handback" else "no fallback may"
        why = f"{who} continue: {'; '.join(self._refused.values()) or NONE_BELOW}"
        self._targets = []
        if kind in REPEATED:
            said = self._quiet.get(kind, (0.0, ""))[1]
            self._quiet[kind] = (time.monotonic() + QUIET_S, why)
            if why == said:
                return  # told already
        self._fleet.declines.note(kind, self._answer, server, why)
        level = logging.WARNING if kind == "pressure" else logging.INFO
        log.log(level, "a %s handoff off %s was declined, the answer stays: %s", kind, server, why)

    def _refusal(self, server: Upstream) -> str | None:
        if self._admits(server):
            return self._next.refusal(server)
        said = self._fleet.unproven(
            [server], lambda _: False, self._next.dialect.name, self._spaced()
        )
        return said.removeprefix("; ") or f"{server.url} does not serve this client"

    async def _asked_refusal(self, server: Upstream) -> str | None:
        try:
            return await self._next.asked_refusal(server)
        except Exception as exc:  # whatever failed, it would fail at the moment of use too
            log.exception("cannot build the continuation for %s", server.url)
            return f"cannot build a continuation for {server.url}: {exc!r}"
