"""The loop the GPU proof repeats, shared with its CPU rehearsal (tests/test_gpu_rehearsal.py):
the ballast taken before the proxy watches the card, then runs until the budget is
spent: wait until the card is re-armed and the primary takes new answers again, stream
an answer, take memory mid-answer (a step, or another server loading), check the answer
handed off cleanly, give the memory back."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from scripts.gpu.hog import Hog
from scripts.gpu.plan import Plan, plan_memory
from scripts.gpu.stats import RunResult, Summary
from scripts.gpu.testbed import ProofBed, one_run

Status = Callable[[], dict[str, Any]]


def take_ballast(hog: Hog, plan: Plan) -> list[str]:
    """The plan's ballast, before the proxy starts; what went wrong, if anything (a card
    that filled faster than planned keeps what it took)."""
    for chunk in plan.ballast_mib:
        try:
            hog.ask(op="alloc", what="ballast", mib=chunk)
        except RuntimeError as exc:
            return [f"ballast: {exc}"]
    return []


def readiness(status: dict[str, Any], card: str, primary: str) -> str | None:
    """None when the card is armed, the primary takes new answers and none is live; else
    what was seen, in words."""
    reading = status.get("memory", {}).get("cards", {}).get(card, {})
    states = status.get("routing", {}).get("states", {})
    live = status.get("live", [])
    if reading.get("armed") and states.get(primary, {}).get("state") == "ok" and not live:
        return None
    used, total = reading.get("used_mib"), reading.get("total_mib")
    if used is None or total is None:
        memory = "no reading"
    else:
        memory = f"{used:,.0f} of {total:,.0f} MiB used ({total - used:,.0f} free"
        if (rest := reading.get("rest_free_mib")) is not None:
            memory += f"; {rest:,.0f} free at rest"
        memory += ")"
    servers = ", ".join(
        f"{url} {s.get('state')}" + (f" ({s['why']})" if s.get("why") else "")
        for url, s in states.items()
    )
    answers = "; ".join(
        f"{a.get('server')} {a.get('tokens')} tokens, {a.get('handoffs')} handoffs" for a in live
    )
    return (
        f"{card}: {memory}, armed {reading.get('armed')}, fired {reading.get('fired')}"
        f"{'' if reading.get('error') is None else ', error ' + str(reading['error'])}; "
        f"servers: {servers or 'none'}; live answers: {len(live)}"
        + (f" ({answers})" if answers else "")
    )


def wait_ready(status: Status, card: str, primary: str, until: float) -> str | None:
    """Wait until `readiness` holds; None when it did, else what it waited for and the
    last it saw."""
    while True:
        seen = readiness(status(), card, primary)
        if seen is None:
            return None
        if time.monotonic() >= until:
            return f"waited for {card} armed, {primary} ok and no live answer; last seen: {seen}"
        time.sleep(0.02)


class Pressure(Protocol):
    """What takes the card in each run."""

    kind: str

    def take(self) -> None:
        """Start taking memory; called by the stream reader mid-answer, so it returns fast."""

    def taken(self, result: RunResult) -> None:
        """Once the answer is over: when the memory was taken, into the result."""

    def give_back(self) -> None:
        """Give the memory back (and wait until it is)."""


@dataclass
class Step:
    """The memory helper takes `mib` at once (a torch allocation, or a file card's counter)."""

    hog: Hog
    mib: int
    kind: str = "step"
    sent: bool = False

    def take(self) -> None:
        self.hog.send(op="alloc", what="step", mib=self.mib)
        self.sent = True

    def taken(self, result: RunResult) -> None:
        if self.sent:
            answer = self.hog.reply(timeout=60)
            result.alloc_start, result.alloc_done = answer["t0"], answer["t1"]
            result.nvml_seen = answer.get("nvml_seen")

    def give_back(self) -> None:
        if self.sent:
            self.hog.ask(op="free", what="step", timeout=60)
            self.sent = False


@dataclass
class Runs:
    """What the loop needs: the proxy, the card and primary to watch, the answer's shape."""

    url: str
    status: Status
    card: str
    primary: str
    after_chunks: int = 20
    max_tokens: int = 2000
    ready_s: float = 60  # the longest wait for a card to re-arm before a run
    results: list[RunResult] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def repeat(
    runs: Runs,
    pressure: Pressure,
    until: float,
    most: int,
    on_run: Callable[[RunResult], None] = lambda _: None,
) -> list[RunResult]:
    """Runs under `pressure` until `most` were done or `until` (time.monotonic()) passes;
    stops at the first card that does not re-arm, saying what it saw."""
    done: list[RunResult] = []
    while len(done) < most and time.monotonic() < until:
        waited = wait_ready(runs.status, runs.card, runs.primary, time.monotonic() + runs.ready_s)
        if waited is not None:
            runs.errors.append(f"before run {len(runs.results)}: {waited}")
            break
        try:
            result = one_run(
                len(runs.results), runs.url, pressure.take, runs.after_chunks, runs.max_tokens
            )
            result.kind = pressure.kind
            pressure.taken(result)
        finally:
            pressure.give_back()
        runs.results.append(result)
        done.append(result)
        on_run(result)
    return done


@dataclass
class Settings:
    """The loop's knobs (the proof's command line, or the rehearsal's own)."""

    target_free_mib: float = 6144  # free at rest once the ballast is in
    after_free_mib: float = 1024  # free once a run's step is taken
    after_chunks: int = 20
    max_tokens: int = 2000
    most: int = 40
    card_kind: str = "nvml:"  # the card the primary must be found on


def prepare(
    bed: ProofBed, hog: Hog, settings: Settings, summary: Summary, until: float
) -> tuple[Runs, int] | None:
    """On a bed whose servers are up and whose proxy is not yet: the plan from the
    helper's reading of the card, the ballast, the proxy, the card the primary is on; the
    runs' settings and the step to take, or None (and why, in the errors) when the card is
    not ready for them."""
    errors = summary.extra.setdefault("errors", [])
    used, total = hog.read()
    plan = plan_memory(
        total, used, target_free_mib=settings.target_free_mib,
        after_free_mib=settings.after_free_mib,
    )  # fmt: skip
    errors += take_ballast(hog, plan)
    bed.start_proxy()
    card = bed.card_of_primary(summary, settings.card_kind)
    runs = Runs(
        bed.proxy.url, bed.status, card, bed.primary.url, settings.after_chunks,
        settings.max_tokens, results=summary.runs, errors=errors,
    )  # fmt: skip
    waited = wait_ready(bed.status, card, bed.primary.url, min(time.monotonic() + 60, until))
    reading = bed.status()["memory"]["cards"][card]
    step = int(reading["total_mib"] - reading["used_mib"] - plan.after_free_mib)
    summary.extra["plan"] = {**asdict(plan), "step_mib": step, "card_after_ballast": reading}
    if waited is not None:
        errors.append(f"after the ballast: {waited}")
        return None
    print(
        f"ballast {sum(plan.ballast_mib):,} MiB ({plan.checked}); "
        f"{reading['total_mib'] - reading['used_mib']:,.0f} MiB free at rest; a step takes "
        f"{step:,} MiB more after {settings.after_chunks} chunks"
    )
    return runs, step


def steps_on_card(
    bed: ProofBed,
    hog: Hog,
    settings: Settings,
    summary: Summary,
    until: float,
    on_run: Callable[[RunResult], None] = lambda _: None,
) -> Runs | None:
    """The whole loop: `prepare`, then steps until `until` (or `settings.most` runs)."""
    prepared = prepare(bed, hog, settings, summary, until)
    if prepared is None:
        return None
    runs, step = prepared
    repeat(runs, Step(hog, step), until, settings.most, on_run)
    return runs
