"""The front door and the manual: the README stays short and links only to pages that
exist; the manual in docs/ builds with mkdocs in strict mode (a broken link, an anchor
that is gone or a page left out of the navigation fails)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


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
