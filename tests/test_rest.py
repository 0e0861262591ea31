"""A card over days: memory that another program keeps, a model unloaded and loaded again
behind an open port, a second step while the card is pressured. CardState alone, fed
readings as the monitor takes them (every 20 ms near a line)."""

from __future__ import annotations

from watchers.pressure import CardState, Lines
from watchers.reading import Reading

LINES = Lines(settle_s=30)
GiB = 1024.0


class Card:
    """A card read every `every` seconds; `own` is what its servers hold, where told."""

    def __init__(self, total: float, every: float = 0.02) -> None:
        self.state = CardState("nvml:0")
        self.total = total
        self.every = every
        self.now = 0.0

    def read(self, used: float, own: float | None = None, seconds: float = 0.0) -> list[str]:
        """Readings of `used` for `seconds` (at least two): the lines fired meanwhile."""
        fired = []
        end = self.now + max(seconds, 2 * self.every)
        while self.now < end:
            self.now += self.every
            crossing = self.state.observe(Reading("nvml:0", used, self.total, self.now), LINES, own)
            if crossing is not None:
                fired.append(crossing.line)
        return fired


def test_memory_kept_by_another_program_becomes_the_rest() -> None:
    """A 24 GiB card, 700 MiB free at rest; a program takes 400 MiB and keeps it: fired
    (half of what was free is gone), then clear once it held still for settle_s, with
    that level as its rest; the next step fires again."""
    card = Card(24 * GiB)
    assert card.read(24 * GiB - 700, seconds=1) == []
    assert card.read(24 * GiB - 300) == ["300 MiB free (floor 350)"]
    assert card.read(24 * GiB - 300, seconds=29) == [] and not card.state.armed
    assert card.read(24 * GiB - 300, seconds=1.5) == []
    assert card.state.armed and card.state.rest_free == 300
    assert card.state.rest_how == "held still 30 s"
    assert card.state.pressed(card.now, dwell_s=30) is None  # no dwell: it held still
    assert card.read(24 * GiB - 100) == ["100 MiB free (floor 150)"]


def test_a_level_that_wanders_does_not_settle() -> None:
    """Use moving by more than a quarter of a step within the wait keeps it pressured."""
    card = Card(24 * GiB)
    card.read(24 * GiB - 700, seconds=1)
    assert card.read(24 * GiB - 300) == ["300 MiB free (floor 350)"]
    for _ in range(4):
        card.read(24 * GiB - 560, seconds=10)  # (less back than would clear it: 612)
        card.read(24 * GiB - 300, seconds=10)
    assert not card.state.armed and card.state.fired == 1


def test_a_second_step_while_pressured_fires_again() -> None:
    """The issue's 80 GiB card with 6 GiB free at rest: +3.5 GiB fires; +2 GiB more,
    leaving 0.5 GiB, fires again (the answers still on the card move)."""
    card = Card(80 * GiB)
    card.read(74 * GiB, seconds=1)
    (first,) = card.read(77.5 * GiB)
    assert first.startswith("step +3,584 MiB")
    assert card.read(77.5 * GiB, seconds=2) == []  # held: nothing new
    assert card.read(79.5 * GiB) == ["512 MiB free (floor 1,280)"]
    assert card.state.fired == 2 and not card.state.armed
    # A slow creep while pressured fires once half of what was left is gone too.
    assert card.read(79.5 * GiB + 300, seconds=1) == ["212 MiB free (floor 256)"]


def test_a_model_reloaded_behind_an_open_port_is_not_pressure_where_the_source_says_whose() -> None:
    """llama-swap's ttl: the primary's model (23 GiB of a 24 GiB card) unloaded, loaded
    again in steps; NVML says the memory is the server's own: nothing fires. Another
    program's step afterwards does."""
    card = Card(24 * GiB)
    model = 23 * GiB
    assert card.read(model + 200, own=model, seconds=1) == []
    assert card.read(200, own=0, seconds=5) == []  # unloaded
    assert card.state.rest_free is not None and card.state.rest_free > 23 * GiB
    for loaded in (4 * GiB, 12 * GiB, 20 * GiB, model):
        assert card.read(loaded + 200, own=loaded, seconds=0.3) == []
    assert card.state.armed and card.state.rest_free == 24 * GiB - model - 200
    assert card.read(model + 200 + 500, own=model) == ["324 MiB free (floor 412)"]


def test_the_same_reload_where_nobody_says_whose_settles() -> None:
    """Without a process list (sysfs, a driver that hides it), the reload reads as a
    step: it fires, and once the card holds still it is the rest again."""
    card = Card(24 * GiB)
    card.read(23 * GiB + 200, seconds=1)
    card.read(200, seconds=5)
    assert card.read(23 * GiB + 200, seconds=1)  # fired on the reload
    card.read(23 * GiB + 200, seconds=30)
    assert card.state.armed and card.state.rest_free == 824


def test_whose_memory_it_is_becoming_unknown_is_no_step() -> None:
    """A process list that stops answering: levels before and after are not compared."""
    card = Card(24 * GiB)
    assert card.read(20 * GiB, own=19 * GiB, seconds=1) == []
    assert card.read(20 * GiB, own=None, seconds=1) == []
    assert card.read(20 * GiB, own=19 * GiB, seconds=1) == []


def test_a_rest_lowered_without_firing() -> None:
    """A desktop taking 260 MiB of a card with 6 GiB free: no line crossed; after the wait
    that is the rest, so the lines count from it."""
    card = Card(24 * GiB)
    card.read(18 * GiB, seconds=1)
    assert card.read(18 * GiB + 260, seconds=31) == []
    assert card.state.rest_free == 6 * GiB - 260 and card.state.armed
