"""Mistakes in how the proxy was started, said at start rather than found out later.

mitmproxy keeps an option no addon declared (`--set spillover_fallback=...`, a typo of
`spillover_fallbacks`) for an addon that may come later, and runs on without it: the
proxy would carry answers with no fallback and say nothing. An option of the addon's
given twice (`--set spillover_fallbacks=a --set spillover_fallbacks=b`) fails the
addon's loading, and mitmproxy runs on without the addon, saying nothing either.
"""

from __future__ import annotations

import atexit
import difflib
import functools
import logging
import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any

PREFIX = "spillover_"
log = logging.getLogger(__name__)


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name that `name` is likeliest a typo of, if any is close (compared
    without the prefix, which would make every `spillover_*` name close)."""
    tails = {option.removeprefix(PREFIX): option for option in known}
    close = difflib.get_close_matches(name.removeprefix(PREFIX), list(tails), n=1, cutoff=0.6)
    return tails[close[0]] if close else None


def unknown_options(given: Iterable[str], known: Iterable[str]) -> list[str]:
    """What to say of each `spillover_*` option given that no addon declared, with the
    declared name it is closest to."""
    ours = sorted(name for name in known if name.startswith(PREFIX))
    said = []
    for name in sorted(n for n in given if n.startswith(PREFIX)):
        close = closest(name, ours)
        hint = f"; did you mean {close}?" if close else f"; ours: {', '.join(ours)}"
        said.append(f"unknown option {name}{hint}")
    return said


def given_twice(deferred: Mapping[str, Any]) -> list[str]:
    """What to say of each `spillover_*` option set more than once on the command line
    (mitmproxy keeps the values of one not yet declared as a list of strings)."""
    said = []
    for name, value in sorted(deferred.items()):
        values = getattr(value, "val", None)
        if name.startswith(PREFIX) and isinstance(values, list) and len(values) > 1:
            said.append(f"{name} is given {len(values)} times ({', '.join(values)}): give it once")
    return said


def refuse_at_start(lines: Iterable[str]) -> bool:
    """Say each line as an error while the proxy starts (mitmproxy's errorcheck then ends
    it with status 1); False when there is none."""
    said = False
    for line in lines:
        log.error("spillover: %s", line)
        said = True
    if said:
        _exit_before_finalizing()
    return said


@functools.cache
def _exit_before_finalizing() -> None:
    """End that exit before Python finalizes. A mode that listens on UDP too (a reverse
    target without a scheme is https: TCP and UDP) runs mitmproxy_rs's threads, and one
    of them taking the GIL while the interpreter finalizes crashes it (SIGSEGV, about one
    refused start in twenty on a loaded machine) instead of exiting with 1. Exit hooks
    run before that point; errorcheck's status is always 1."""

    def exit_now() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    atexit.register(exit_now)
