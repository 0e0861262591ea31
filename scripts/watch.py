"""A live view of a running proxy: cards, servers, answers and handoffs.

    .venv/bin/python -m scripts.watch [--config FILE | --proxy URL] [--token T] [--every-s 0.5]

It reads `GET /spillover/status` (from this machine, or with the control token) and
redraws every `--every-s`; `q` quits. The proxy and its token are the settings file's
(scripts/parts/config.py) where no flag names them.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import httpx
import urwid
from mitmproxy.exceptions import OptionsError

from addon.servers.credentials import read_secret
from addon.servers.urlchecks import url_mistake
from scripts.parts.config import Config, with_config
from scripts.parts.summary import card_now, state_why

PALETTE = [
    ("title", "bold", ""),
    ("ok", "dark green", ""),
    ("bad", "light red", ""),
    ("dim", "dark gray", ""),
]
STATE_STYLE = {"ok": "ok", "pressured": "bad", "down": "bad", "draining": "bad"}


def section(title: str, rows: list[Any], empty: str) -> list[Any]:
    return [("title", title), *(rows or [("dim", f"  {empty}")])]


def card_lines(memory: dict[str, Any]) -> list[Any]:
    rows: list[Any] = []
    for card, state in sorted((memory.get("cards") or {}).items()):
        used, total = state.get("used_mib"), state.get("total_mib")
        size = f"{used:>10,.0f} of {total:,.0f} MiB" if total else f"{used or 0:>10,.0f} MiB"
        armed = "armed" if state.get("armed") else "fired, not re-armed"
        rows.append(
            [f"  {card:14} {size}   floor {state.get('floor_mib') or 0:,.0f} MiB   ",
             ("ok" if state.get("armed") else "bad", armed),
             f"   fired {state.get('fired') or 0}"]
        )  # fmt: skip
        rows += [("dim", f"      {said}") for said in card_now(state)]
    return section("cards", rows, "none watched")


def server_lines(status: dict[str, Any]) -> list[Any]:
    routing = status.get("routing") or {}
    live = routing.get("live_per_server") or {}
    mapping = (status.get("memory") or {}).get("servers") or {}
    rows: list[Any] = []
    for url, state in (routing.get("states") or {}).items():
        name = state.get("state", "?")
        why = state_why(state)
        cards = ", ".join((mapping.get(url) or {}).get("cards") or []) or "-"
        rows.append(
            [f"  {url:28} ", (STATE_STYLE.get(name, "dim"), f"{name:10}"),
             f" live {live.get(url, 0):<3} cards {cards}{why}"]
        )  # fmt: skip
    return section("servers", rows, "none known")


def answer_lines(status: dict[str, Any]) -> list[Any]:
    rows = []
    for answer in status.get("live") or []:
        shadow = answer.get("shadow")
        shadowed = f"   shadow on {shadow['server']}" if shadow and not shadow["ended"] else ""
        rows.append(
            f"  {answer['flow'][:8]}  {answer['api']:15} on {answer['server']:28}"
            f" {answer['tokens']:>6} tokens"
            f"   handoffs {answer['handoffs']}{shadowed}"
        )
    return section("answers", rows, "none streaming")


def handoff_lines(status: dict[str, Any]) -> list[Any]:
    rows = []
    for handoff in reversed(status.get("recent_handoffs") or []):
        at = time.strftime("%H:%M:%S", time.localtime(handoff["at"]))
        replay = f", {handoff['replay']}" if handoff.get("replay") else ""
        paused = handoff.get("pause_ms")
        pause = f"pause {paused:.1f} ms" if paused is not None else "no byte from it yet"
        rows.append(
            f"  {at}  {handoff['kind']:9} {handoff['source']} -> {handoff['target']}"
            f" after {handoff['at_token']} tokens, {pause}{replay}"
        )
    return section("recent handoffs", rows, "none yet")


def screen(status: dict[str, Any]) -> list[Any]:
    """The view's lines (urwid text markup), section by section."""
    sections = (card_lines(status.get("memory") or {}), server_lines(status))
    sections += (answer_lines(status), handoff_lines(status))
    lines: list[Any] = []
    for section in sections:
        lines += [*section, ""]
    return lines


class LiveView:
    def __init__(self, proxy: str, token: str | None, every_s: float) -> None:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(base_url=proxy, headers=headers, timeout=1.0)
        self._every_s = every_s
        self._header = urwid.Text("")
        self._body = urwid.Text("")
        frame = urwid.Frame(urwid.Filler(self._body, valign="top"), header=self._header)
        self.loop = urwid.MainLoop(frame, PALETTE, unhandled_input=self._key)
        self._proxy = proxy

    def _key(self, key: str) -> None:
        if key in ("q", "Q"):
            raise urwid.ExitMainLoop()

    def refresh(self, *_: Any) -> None:
        clock = time.strftime("%H:%M:%S")
        try:
            status = self._client.get("/spillover/status").raise_for_status().json()
        except (httpx.HTTPError, ValueError) as exc:
            self._header.set_text(("bad", f"{self._proxy}  {clock}  not answering: {exc!r:.80}"))
        else:
            self._header.set_text(("title", f"spillover at {self._proxy}  {clock}   q: quit"))
            self._body.set_text([part for line in screen(status) for part in (line, "\n")])
        self.loop.set_alarm_in(self._every_s, self.refresh)

    def run(self) -> None:
        self.refresh()
        self.loop.run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proxy", help="the proxy's URL (default: http://127.0.0.1:8090)")
    parser.add_argument(
        "--token", help="the control token (spillover_control_token; @/path reads a file)"
    )
    parser.add_argument("--every-s", type=float, default=0.5, help="seconds between redraws")
    args, _ = with_config(parser, "watch", from_config)
    if mistake := url_mistake(args.proxy, "proxy"):
        parser.exit(2, f"watch: {mistake}\n")
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        parser.exit(2, "watch: it draws on a terminal: run it in one (or GET /spillover/status)\n")
    try:
        token = read_secret(args.token) if args.token else None
    except OptionsError as exc:  # a token file this user may not read
        parser.exit(2, f"watch: {exc}\n")
    LiveView(args.proxy.rstrip("/"), token, args.every_s).run()


def from_config(config: Config) -> dict[str, str | None]:
    return {"proxy": config.proxy_url(), "token": config.option("control_token")}


if __name__ == "__main__":
    main()
