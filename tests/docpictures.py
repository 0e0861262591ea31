"""The manual's screenshots are taken by the tests that check what they show; with
SPILLOVER_WRITE_DOCS set, those tests put them in docs/:

    SPILLOVER_WRITE_DOCS=1 .venv/bin/python -m pytest tests/test_live_view.py tests/test_mitmweb.py
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def keep_for_docs(picture: Path, name: str) -> None:
    if os.environ.get("SPILLOVER_WRITE_DOCS"):
        shutil.copyfile(picture, DOCS / name)
