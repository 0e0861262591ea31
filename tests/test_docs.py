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

REPO = Path(__file__).resolve().parent.parent
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
    """`scripts.timeline` runs two llama-servers and the addon, steps the primary's card,
    and draws what the client read: both servers' tokens, the memory step, the decision
    and the pause."""
    out = tmp_path / "timeline.svg"
    run = subprocess.run(
        [sys.executable, "-m", "scripts.timeline", "--out", str(out)],
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
