"""What the GPU proof (and its CPU rehearsal) takes of a card, checked against the
project's own pressure logic before anything is taken.

The watcher measures pressure against a card's rest: the most it had free since it was
first read (or since a server on it came up). So the ballast goes in before the proxy
watches the card (it is part of the rest, and can never fire), and what each run takes
after that is what must fire: a step that leaves about `after_free` MiB. Giving the step
back brings the card to its rest, where it must re-arm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CHUNK_MIB = 16384  # the ballast in allocations of at most this (a card may refuse a huge one)


@dataclass
class Plan:
    ballast_mib: list[int]  # chunks, all taken before the proxy starts
    rest_free_mib: float  # what the card has free at rest once the ballast is in
    step_mib: int  # what each run takes after that
    after_free_mib: float  # ... leaving this much free
    checked: str  # how the plan was checked against the lines
    step_fires: bool | None = None  # whether the step crosses a line (None: not known)
    rearms: bool | None = None  # whether the card re-arms once the step is given back
    notes: list[str] = field(default_factory=list)


class PressureSimulator:
    """The project's own pressure logic (watchers.pressure) with its default lines, read
    every 5 ms (denser than the monitor ever reads, so it fires at least as readily),
    starting from a card at rest with `free_mib` free."""

    def __init__(self, total_mib: float, free_mib: float) -> None:
        from watchers.pressure import CardState, Lines
        from watchers.reading import Reading

        self._reading, self.lines = Reading, Lines()
        self.state = CardState("plan")
        self.total, self.free, self.now = total_mib, free_mib, 0.0
        self._idle(1.0)

    def _idle(self, duration_s: float) -> bool:
        fired = False
        end = self.now + duration_s
        while self.now < end:
            reading = self._reading("plan", self.total - self.free, self.total, self.now)
            fired |= bool(self.state.observe(reading, self.lines))
            self.now += 0.005
        return fired

    def allocate(self, free_after: float, duration_s: float) -> bool:
        """Memory goes to `free_after` free now, then `duration_s` passes: whether it fired."""
        self.free = free_after
        return self._idle(duration_s)

    @property
    def armed(self) -> bool:
        return self.state.armed


def plan_memory(
    total_mib: float,
    used_mib: float,
    *,
    target_free_mib: float = 6144,
    after_free_mib: float = 1024,
    check: bool = True,
) -> Plan:
    """Ballast down to `target_free_mib` free (taken before the proxy starts), then a step
    per run leaving `after_free_mib`; with `check`, replayed against watchers.pressure:
    the step must fire, and the card must re-arm once the step is given back."""
    free = total_mib - used_mib
    notes: list[str] = []
    if free < target_free_mib:
        notes.append(f"only {free:,.0f} MiB free: no ballast, the runs start from that")
        target_free_mib = free
        # a card full at rest acts once half of what it has free is taken
        after_free_mib = min(after_free_mib, free / 4)
    ballast, left = [], int(free - target_free_mib)
    while left > 0:
        ballast.append(min(left, CHUNK_MIB))
        left -= ballast[-1]
    step = int(target_free_mib - after_free_mib)
    plan = Plan(ballast, target_free_mib, step, after_free_mib, "", notes=notes)
    if not check:
        plan.checked = "not checked"
        return plan
    try:
        sim = PressureSimulator(total_mib, target_free_mib)
        plan.step_fires = sim.allocate(after_free_mib, 0.05)
        sim.allocate(target_free_mib, 0.05)
        plan.rearms = sim.armed
        plan.checked = "watchers.pressure, default lines"
    except Exception as exc:  # the pressure module changed shape: run without the check
        plan.checked = f"not checked: pressure logic not usable ({exc!r})"
    if plan.step_fires is False:
        notes.append(f"a step to {after_free_mib:,.0f} MiB free crosses no line at this rest")
    if plan.rearms is False:
        notes.append("the card does not re-arm at its rest once the step is given back")
    return plan
