"""What an operator reads: mistakes in how the proxy is started get a word at start, and
its log says what happened to answers (a real mitmdump each time)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from addon.surface.mistakes import unknown_options
from scripts.parts.processes import free_port
from scripts.testbed.mitm import Mitmdump
from tests.streams import chat_body, read_stream


def test_a_mistyped_option_is_refused_with_the_name_it_is_closest_to(tmp_path: Path) -> None:
    proxy = Mitmdump(f"http://127.0.0.1:{free_port()}", options=["spillover_fallback=x"])
    run = subprocess.run(proxy.argv(), capture_output=True, text=True, timeout=60)
    said = run.stdout + run.stderr
    assert "unknown option spillover_fallback; did you mean spillover_fallbacks?" in said
    assert "spillover: not started; fix the options above" in said


def test_an_option_given_twice_is_refused_rather_than_the_addon_left_out() -> None:
    """mitmproxy fails to load an addon whose option came twice, and runs on without it."""
    options = ["spillover_fallbacks=http://127.0.0.1:1", "spillover_fallbacks=http://127.0.0.1:2"]
    proxy = Mitmdump(f"http://127.0.0.1:{free_port()}", options=options)
    run = subprocess.run(proxy.argv(), capture_output=True, text=True, timeout=60)
    said = run.stdout + run.stderr
    assert "spillover_fallbacks is given 3 times" in said  # (the test bed sets it once too)
    assert "spillover: not started; fix the options above" in said


def test_no_fallback_is_a_warning(start_proxy) -> None:
    proxy = start_proxy(f"http://127.0.0.1:{free_port()}", [])
    proxy.stop()
    log = proxy.log_path.read_text()
    assert "spillover: no fallbacks (spillover_fallbacks): answers are carried, but" in log


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("spillover_fallback", "did you mean spillover_fallbacks?"),
        ("spillover_cards_of", "did you mean spillover_cards?"),
        ("spillover_zzz", "ours: spillover_cards, spillover_fallbacks"),
    ],
)
def test_the_closest_name_is_found_by_what_follows_the_prefix(given: str, said: str) -> None:
    (message,) = unknown_options(
        [given, "block_global"], ["spillover_fallbacks", "spillover_cards"]
    )
    assert message == f"unknown option {given}; {said}"


def test_the_log_has_a_line_per_handoff_and_per_answer_that_could_not_go_on(
    start_server, start_proxy, fallback
) -> None:
    """What an operator reads: one line per handoff and per answer cut short, each naming
    its servers; none per question the addon's own client asks (a /health every second)."""
    primary = start_server("primary")
    proxy = start_proxy(primary.url, [fallback.url])
    kill = lambda n: n == 40 and primary.kill()  # noqa: E731
    assert read_stream(proxy.url, chat_body(300), on_chunk=kill).done == 1
    lonely = start_server("primary")
    alone = start_proxy(lonely.url, [])
    kill = lambda n: n == 40 and lonely.kill()  # noqa: E731
    assert read_stream(alone.url, chat_body(300), on_chunk=kill).errors
    proxy.stop()
    alone.stop()
    log = proxy.log_path.read_text()
    (line,) = [line for line in log.splitlines() if " handoff " in line]
    assert f"failure handoff {primary.url} -> {fallback.url} after " in line
    assert "first byte after" in line and "HTTP Request:" not in log
    ended = [line for line in alone.log_path.read_text().splitlines() if " ended " in line]
    assert len(ended) == 1 and f"an answer to {lonely.url} ended after " in ended[0]
    assert "no server could continue this answer" in ended[0]


def test_a_handoff_whose_next_leg_failed_is_listed_as_it_is_counted(start_server, start_proxy):
    """The fallback was proven at start and is gone by the handoff (health checks off, so
    the proxy does not know): the handoff to it is counted and listed alike."""
    primary, doomed = start_server("primary"), start_server("fallback")
    proxy = start_proxy(primary.url, [doomed.url], options=["spillover_health_s=0"])
    proxy.servers_known()
    doomed.kill()
    stream = read_stream(proxy.url, chat_body(300), on_chunk=lambda n: n == 40 and primary.kill())
    assert (
        stream.errors and f"cannot connect to {doomed.url}" in stream.errors[0]["error"]["message"]
    )
    status = httpx.get(f"{proxy.url}/spillover/status").json()
    (listed,) = status["recent_handoffs"]
    assert (listed["target"], listed["kind"], listed.get("pause_ms")) == (
        doomed.url,
        "failure",
        None,
    )
    metrics = httpx.get(f"{proxy.url}/spillover/metrics").text
    assert 'spillover_handoffs_total{kind="failure"} 1.0' in metrics


def test_the_live_view_without_a_terminal_says_it_needs_one() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "scripts.watch"], stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2 and "it draws on a terminal" in run.stderr
    assert "Traceback" not in run.stderr
