"""The installed `spillover` command's package.

A wheel puts the project's own packages (`addon`, `watchers`, `scripts`) inside this one,
not at the top of site-packages, where names that plain would collide with other
projects'; the command puts their folder on its own import path only, then runs
`scripts.cli`. From a checkout (or an editable install) that folder is the checkout.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def main() -> None:
    spec = importlib.util.find_spec("spillover.addon")
    assert spec is not None and spec.origin is not None, "spillover.addon is not installed"
    root = str(Path(spec.origin).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from scripts.cli import main as cli

    cli()
