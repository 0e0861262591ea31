"""The front door and the manual: the README stays short and links only to pages that
exist; the manual in docs/ builds with mkdocs in strict mode (a broken link, an anchor
that is gone or a page left out of the navigation fails)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import httpx
import pytest

from scripts.testbed.llamaserver import find_binary
from scripts.testbed.prompts import chat_body
from tests.quickstart import (
    PROXY,
    REPO,
    doc_block,
    quick_start_ports,
    running_as_written,
    wait_until_ready,
    your_models,
)
from tests.streams import read_stream
from tests.throttle import Throttled
from watchers.listeners import listening_pids

SVG = "{http://www.w3.org/2000/svg}"


def test_the_readme_is_a_front_door_whose_links_lead_somewhere() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert links and all((REPO / link).is_file() for link in links), links
    pages = {p.name for p in (REPO / "docs").glob("*.md")} - {"index.md"}
    assert pages <= {Path(link).name for link in links}  # every page is reached from it


def test_the_manual_builds_in_strict_mode(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    assert (tmp_path / "site" / "workers" / "index.html").is_file()


def test_the_handoff_timeline_is_drawn_from_a_real_run(tmp_path: Path) -> None:
    """`scripts.testbed.timeline` runs two llama-servers and the addon, steps the primary's card,
    and draws what the client read: both servers' tokens, the memory step, the decision
    and the pause."""
    out = tmp_path / "timeline.svg"
    run = subprocess.run(
        [sys.executable, "-m", "scripts.testbed.timeline", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    svg = ET.parse(out).getroot()
    lines = {p.get("class"): p.get("points").split() for p in svg.iter(f"{SVG}polyline")}
    assert set(lines) == {"primary", "fallback"}
    assert len(lines["primary"]) + len(lines["fallback"]) == 600
    assert len(lines["primary"]) >= 300  # the step came once the client had 300 tokens
    said = " ".join(t.text or "" for t in svg.iter(f"{SVG}text"))
    assert "card0: +5 GB used" in said and "handoff note" in said
    assert re.search(r"pause before the fallback's first token: \d+\.\d ms", said)
    assert "memory pressure on drm:card0" in run.stdout


def test_the_quick_start_runs_as_written(tmp_path: Path) -> None:
    """The README's five lines for your own server, run by bash from the checkout: the
    proxy on 8090 answers a question with the primary's own answer. (Skipped where
    another program holds one of its ports.)"""
    with quick_start_ports():
        script = doc_block("README.md", "## By hand, on the tiny models\n")
        with running_as_written(script, tmp_path, {}, cwd=REPO):
            wait_until_ready("http://127.0.0.1:8082")
            body = {**chat_body(8), "stream": False}
            via = httpx.post(f"{PROXY}/v1/chat/completions", json=body, timeout=60)
            direct = httpx.post("http://127.0.0.1:8081/v1/chat/completions", json=body, timeout=60)
        assert via.status_code == 200
        answer = via.json()["choices"][0]["message"]["content"]
        assert answer and answer == direct.json()["choices"][0]["message"]["content"]


def ask(primary: Throttled) -> None:
    with primary.held():
        httpx.post(f"{PROXY}/spillover/handoff")


@pytest.mark.parametrize(
    "heading", ["## Two cards: ", "## One model over two cards", "## One card: "]
)
def test_the_cards_quick_starts_run_as_written(
    heading: str, models: dict[str, Path], tmp_path: Path
) -> None:
    """docs/your-cards.md's blocks for two cards, one model over two, and one card, run by
    bash: the first line
    (your models) set to the tiny ones, `llama-server` the one the setup found,
    `spillover` this checkout's; the rest as written. No GPU here, so the servers run on
    the CPU (`-ngl 99` offloads nothing, `CUDA_VISIBLE_DEVICES` picks nothing). A
    handoff asked of the proxy goes to the fallback."""
    script = your_models(
        doc_block("docs/your-cards.md", heading), BIG=models["primary"], SMALL=models["fallback"]
    )
    printed = tmp_path / "printed"
    commands = {"llama-server": find_binary()}
    with quick_start_ports(), running_as_written(script, tmp_path, commands, output=printed):
        wait_until_ready("http://127.0.0.1:8082")
        # The tiny primary throttled, as on a slow card: unthrottled it writes the whole
        # answer to the proxy before a loaded machine's client reads 3 chunks.
        with Throttled(*listening_pids(8081)) as primary:
            stream = read_stream(PROXY, chat_body(800), on_chunk=lambda n: n == 3 and ask(primary))
    assert stream.status == 200 and len(stream.notes) == 1, stream.notes
    assert "http://127.0.0.1:8081 -> http://127.0.0.1:8082" in stream.notes[0]
    if "doctor" in script:  # run once both answered: it names each server's model
        said = printed.read_text()
        assert "ok  http://127.0.0.1:8081: llama-server, primary.gguf" in said, said
        assert "ok  http://127.0.0.1:8082: llama-server, fallback.gguf" in said, said
