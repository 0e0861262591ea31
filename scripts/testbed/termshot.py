"""A terminal screen, as `tmux capture-pane -p -e` gives it (text with SGR colour codes),
drawn as SVG: the live view's picture in the manual is one real screen of a test run.

    tmux capture-pane -p -e -t SESSION | .venv/bin/python -m scripts.testbed.termshot > screen.svg
"""

from __future__ import annotations

import html
import re
import sys

SGR = re.compile(r"\x1b\[([0-9;]*)m")
CELL_W, CELL_H, PAD = 8.4, 17, 12
BACKGROUND, FOREGROUND = "#1e1e1e", "#d4d4d4"
BOLD = ' font-weight="bold"'
# The 8 normal and 8 bright ANSI colours, as common dark themes draw them; black as dark
# grey, which is how urwid's "dark gray" reaches tmux.
COLOURS = {
    30: "#767676", 31: "#cd3131", 32: "#0dbc79", 33: "#e5e510",
    34: "#2472c8", 35: "#bc3fbc", 36: "#11a8cd", 37: "#e5e5e5",
    90: "#767676", 91: "#f14c4c", 92: "#23d18b", 93: "#f5f543",
    94: "#3b8eea", 95: "#d670d6", 96: "#29b8db", 97: "#ffffff",
}  # fmt: skip


Style = tuple[str | None, bool]  # a colour (None: the default) and whether bold


def spans(line: str, style: Style = (None, False)) -> tuple[list[tuple[str, Style]], Style]:
    """The (text, style) runs of one line, and the style at its end: tmux writes a
    change of style only where it changes, so it carries over to the next line."""
    runs: list[tuple[str, Style]] = []
    (colour, bold), at = style, 0
    for code in SGR.finditer(line):
        if code.start() > at:
            runs.append((line[at : code.start()], (colour, bold)))
        for number in [int(n) for n in code.group(1).split(";") if n] or [0]:
            if number == 0:
                colour, bold = None, False
            elif number == 1:
                bold = True
            elif number == 22:
                bold = False
            elif number == 39:
                colour = None
            elif number in COLOURS:
                colour = COLOURS[number]
        at = code.end()
    if at < len(line):
        runs.append((line[at:], (colour, bold)))
    return runs, (colour, bold)


def svg_of_screen(screen: str) -> str:
    lines = screen.rstrip("\n").split("\n")
    width = max((len(SGR.sub("", line)) for line in lines), default=0)
    w, h = width * CELL_W + 2 * PAD, len(lines) * CELL_H + 2 * PAD
    rows, style = [], (None, False)
    for index, line in enumerate(lines):
        y = PAD + (index + 0.78) * CELL_H
        runs, style = spans(line, style)
        tspans = "".join(
            f'<tspan fill="{colour or FOREGROUND}"{BOLD if bold else ""}>'
            f"{html.escape(text)}</tspan>"
            for text, (colour, bold) in runs
        )
        if tspans:
            rows.append(f'<text x="{PAD}" y="{y:.1f}" xml:space="preserve">{tspans}</text>')
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w:.0f}" height="{h:.0f}" '
        f'viewBox="0 0 {w:.0f} {h:.0f}" font-family="DejaVu Sans Mono, monospace" '
        f'font-size="14">\n<rect width="100%" height="100%" rx="6" fill="{BACKGROUND}"/>\n'
        + "\n".join(rows)
        + "\n</svg>\n"
    )


def main() -> None:
    sys.stdout.write(svg_of_screen(sys.stdin.read()))


if __name__ == "__main__":
    main()
