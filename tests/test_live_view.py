"""The live terminal view (`scripts.watch`), driven in a real tmux against a real proxy:
what a person sees is read off the screen. Skipped only where tmux is not installed
(scripts/test.sh installs it when it may)."""

from __future__ import annotations

import html
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from scripts.testbed.memfiles import FakeCard
from scripts.testbed.mitm import REPO, watch_sysfs
from scripts.testbed.termshot import COLOURS, svg_of_screen
from scripts.watch import handoff_lines
from tests.docpictures import keep_for_docs
from tests.streams import assert_one_clean_stream, chat_body, read_stream
from tests.test_splice import handoff, held

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="no tmux here")


class Tmux:
    def __init__(self, name: str, command: list[str]) -> None:
        self.name = name
        subprocess.run(
            ["tmux", "new-session", "-d", "-s", name, "-x", "160", "-y", "50", *command],
            check=True, cwd=REPO,
        )  # fmt: skip

    def screen(self, colours: bool = False) -> str:
        return subprocess.run(
            ["tmux", "capture-pane", "-p", *(["-e"] if colours else []), "-t", self.name],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip

    def wait_for(self, seen: Callable[[str], bool], timeout: float = 20) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if seen(screen := self.screen()):
                return screen
            time.sleep(0.1)
        raise AssertionError(f"not seen on the screen:\n{self.screen()}")

    def alive(self) -> bool:
        return subprocess.run(["tmux", "has-session", "-t", self.name]).returncode == 0

    def kill(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def test_the_view_shows_cards_servers_a_live_answer_and_its_handoff(
    start_server, start_proxy, tmp_path: Path
) -> None:
    primary = start_server("primary", ctx_size=8192, slots=2)
    fallback = start_server("fallback", ctx_size=8192, slots=2)
    sysfs = tmp_path / "sys"
    FakeCard(sysfs, "card0", total_mib=16384, used_mib=10000)
    FakeCard(sysfs, "card1", total_mib=8192, used_mib=2000)
    on = {primary.url: "drm:card0", fallback.url: "drm:card1"}
    proxy = start_proxy(primary.url, [fallback.url], options=watch_sysfs(sysfs, on))
    view = Tmux(
        f"spillover-view-{proxy.port}",
        [sys.executable, "-m", "scripts.watch", "--proxy", proxy.url, "--every-s", "0.2"],
    )
    try:
        # A whole frame, not one caught while it is drawn (a loaded machine draws slowly).
        whole = ("drm:card0", "drm:card1", "none streaming", "none yet", f"{fallback.url:28}")
        screen = view.wait_for(lambda s: all(part in s for part in whole))
        assert "10,000 of 16,384 MiB   floor 512 MiB   armed   fired 0" in screen
        assert "none streaming" in screen and "none yet" in screen
        assert f"{primary.url:28} ok" in screen and f"{fallback.url:28} ok" in screen

        def on_chunk(n: int) -> None:
            if n == 20:
                with held(primary):  # the answer stays live while the screen is read
                    row = f"{'chat':15} on {primary.url}"  # the answer's API, its server
                    view.wait_for(lambda s: row in s and "tokens" in s)
                    handoff(proxy, reason="seen in the view")

        stream = read_stream(proxy.url, chat_body(300), on_chunk=on_chunk)
        assert_one_clean_stream(stream)
        # The row shows once the pause is known; the answer is over at a later refresh.
        screen = view.wait_for(
            lambda s: f"{primary.url} -> {fallback.url}" in s and "none streaming" in s
        )
        (row,) = [line for line in screen.splitlines() if f"-> {fallback.url}" in line]
        assert "requested" in row and "pause" in row and " ms" in row, row
        # The manual's picture of the view is this screen, colours and all.
        picture = tmp_path / "live-view.svg"
        picture.write_text(svg_of_screen(view.screen(colours=True)))
        drawn = picture.read_text()
        assert html.escape(row.strip()) in drawn and f'fill="{COLOURS[32]}"' in drawn
        keep_for_docs(picture, "live-view.svg")

        subprocess.run(["tmux", "send-keys", "-t", view.name, "q"], check=True)
        deadline = time.monotonic() + 10
        while view.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not view.alive(), "q did not quit the view"
    finally:
        view.kill()


def test_a_handoff_with_no_byte_after_it_yet_is_drawn() -> None:
    """recent_handoffs lists a handoff as it is decided: its pause comes later, or never."""
    handoff = {"at": 0, "kind": "failure", "source": "http://a", "target": "http://b"}
    status = {"recent_handoffs": [{**handoff, "at_token": 40, "pause_ms": None}]}
    drawn = str(handoff_lines(status))
    assert "http://a -> http://b after 40 tokens, no byte from it yet" in drawn
