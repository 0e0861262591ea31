"""Draw one real handoff as a timeline (SVG): the tokens a client receives over time from
each server, the moment another process takes memory on the primary's card, the
handoff note, and the pause before the fallback's first token.

It runs what the demo runs (two llama-servers on the tiny models, the addon, a sysfs card
of real files whose memory is stepped once the client has 300 tokens) and draws what the
client saw, timed where the client read it. Shadow prefill is off: on a machine where both
servers share the CPU, its work on the fallback slows the primary's decoding (flat
stretches of 5-60 ms in the primary's line, measured here), which is not what the picture
is about.

    .venv/bin/python -m scripts.testbed.timeline [--out docs/handoff-timeline.svg]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

import httpx

from scripts.parts.processes import running
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.memfiles import FakeCard
from scripts.testbed.mitm import Mitmdump, watch_sysfs
from scripts.testbed.tinymodels import ensure_models

TOKENS, STEP_AT = 600, 300
WIDTH, HEIGHT, LEFT, BOTTOM, TOP, RIGHT = 860, 380, 60, 50, 40, 20
COLOURS = {"primary": "#3b6fb6", "fallback": "#e07b24"}


@dataclass
class Run:
    tokens: list[tuple[float, str]] = field(default_factory=list)  # (ms, which server)
    step_ms: float | None = None
    note_ms: float | None = None
    note: str = ""
    handoff: dict = field(default_factory=dict)


def record(proxy: Mitmdump, card: FakeCard, primary_model: str) -> Run:
    """Stream one answer, step the card's memory at STEP_AT tokens, time what arrives."""
    run = Run()
    body = {
        "messages": [{"role": "user", "content": "Tell me a long story about the river."}],
        "max_tokens": TOKENS, "temperature": 0, "stream": True,
    }  # fmt: skip
    start = time.perf_counter()
    with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            now = (time.perf_counter() - start) * 1000
            if line.startswith(":") and run.note_ms is None:
                run.note_ms, run.note = now, line.lstrip(": ")
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    server = "primary" if chunk.get("model") == primary_model else "fallback"
                    run.tokens.append((now, server))
            if len(run.tokens) == STEP_AT and run.step_ms is None:
                card.set_used(15041)
                run.step_ms = (time.perf_counter() - start) * 1000
    handoffs = httpx.get(f"{proxy.url}/spillover/status").json()["recent_handoffs"]
    run.handoff = handoffs[0] if handoffs else {}
    return run


def render(run: Run) -> str:
    """The run as an SVG document: tokens over time, one colour per server."""
    end = max(ms for ms, _ in run.tokens)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(ms: float) -> float:
        return LEFT + plot_w * ms / end

    def y(count: float) -> float:
        return TOP + plot_h * (1 - count / len(run.tokens))

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{LEFT}" y="22" font-size="14">One answer, 600 tokens, as the client read '
        "it: memory taken on the primary's card, the answer goes on from the fallback</text>",
        f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{LEFT + plot_w}" y2="{TOP + plot_h}" '
        'stroke="black"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + plot_h}" stroke="black"/>',
        f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 12}" text-anchor="middle">ms since the '
        "request</text>",
        f'<text x="16" y="{TOP + plot_h / 2}" transform="rotate(-90 16 {TOP + plot_h / 2})" '
        'text-anchor="middle">tokens received</text>',
    ]
    for tick in range(0, int(end) + 1, _tick(end)):
        parts.append(
            f'<text x="{x(tick):.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">{tick}</text>'
        )
    for count in range(0, len(run.tokens) + 1, 100):
        parts.append(
            f'<text x="{LEFT - 6}" y="{y(count) + 4:.1f}" text-anchor="end">{count}</text>'
        )
    for server, colour in COLOURS.items():
        points = " ".join(
            f"{x(ms):.1f},{y(i + 1):.1f}" for i, (ms, who) in enumerate(run.tokens) if who == server
        )
        if points:
            parts.append(
                f'<polyline class="{server}" points="{points}" fill="none" stroke="{colour}" '
                'stroke-width="2"/>'
            )
    legend = [("primary", "primary (tiny model, llama-server)"), ("fallback", "fallback")]
    for i, (server, said) in enumerate(legend):
        ly = TOP + 14 + 18 * i
        parts.append(f'<rect x="{LEFT + 12}" y="{ly - 9}" width="14" height="4" '
                     f'fill="{COLOURS[server]}"/>')  # fmt: skip
        parts.append(f'<text x="{LEFT + 32}" y="{ly}">{said}</text>')
    if run.step_ms is not None:
        parts += _mark(x(run.step_ms), TOP, plot_h, "#b00020", "card0: +5 GB used", 0)
    if run.note_ms is not None:
        within = run.handoff.get("detected_within_ms")
        said = "handoff note" + (f" (pressure seen within {within:.0f} ms)" if within else "")
        parts += _mark(x(run.note_ms), TOP, plot_h, "#555555", said, 1)
        first = next((ms for ms, who in run.tokens if who == "fallback"), None)
        if first is not None:
            parts.append(
                f'<rect class="pause" x="{x(run.note_ms):.1f}" y="{TOP}" '
                f'width="{max(1.0, x(first) - x(run.note_ms)):.1f}" height="{plot_h}" '
                'fill="#e07b24" opacity="0.25"/>'
            )
            pause = first - run.note_ms
            parts.append(
                f'<text x="{x(run.note_ms) - 6:.1f}" y="{TOP + plot_h - 12}" text-anchor="end" '
                f'fill="#a0521a">pause before the fallback\'s first token: {pause:.1f} ms</text>'
            )
    parts.append(f"<!-- {escape(run.note)} -->")
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _mark(at: float, top: float, height: float, colour: str, said: str, row: int) -> list[str]:
    return [
        f'<line x1="{at:.1f}" y1="{top}" x2="{at:.1f}" y2="{top + height}" stroke="{colour}" '
        'stroke-dasharray="4 3"/>',
        f'<text x="{at - 6:.1f}" y="{top + height * 0.62 + 16 * row:.1f}" text-anchor="end" '
        f'fill="{colour}">{escape(said)}</text>',
    ]


def _tick(end: float) -> int:
    for step in (50, 100, 200, 250, 500, 1000, 2000, 5000):
        if end / step <= 10:
            return step
    return 10000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/handoff-timeline.svg"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="spillover-timeline-") as tmp:
        work = Path(tmp)
        models = ensure_models(work / "models")
        primary = LlamaServer(models["primary"], log_dir=work)
        fallback = LlamaServer(models["fallback"], log_dir=work)
        card = FakeCard(work / "sys", "card0", total_mib=16384, used_mib=10000)
        FakeCard(work / "sys", "card1", total_mib=8192, used_mib=1500)
        with running(primary, fallback):
            cards = {primary.url: "drm:card0", fallback.url: "drm:card1"}
            options = [*watch_sysfs(work / "sys", cards), "spillover_shadow=off"]
            proxy = Mitmdump(primary.url, [fallback.url], options=options, log_dir=work)
            with running(proxy):
                proxy.servers_known()
                run = record(proxy, card, str(models["primary"]))
    args.out.write_text(render(run))
    print(f"timeline: {args.out} ({len(run.tokens)} tokens; {run.note})")


if __name__ == "__main__":
    main()
