"""How many connections a process can hold open: a relayed one (an answer's client and its
leg to the server, or the guard's two sides) takes two descriptors. A soft limit of 1,024
open files, systemd's default for a service and many shells', runs out at about 500
answers at once, and every one asked past that gets a 502 (`Too many open files`),
through plain mitmdump as through the addon. Once mitmproxy runs, the soft limit is
raised as far as the hard one allows, as HAProxy and nginx raise theirs; a hard limit
that leaves fewer than FEW_ANSWERS is said once, with what raises it.
"""

from __future__ import annotations

import contextlib
import logging
import resource
from dataclasses import dataclass

log = logging.getLogger(__name__)
SPARE = 64  # descriptors kept for the listeners, health checks, the watcher's files
FEW_ANSWERS = 1000
MOST = 1 << 20  # where the hard limit is unlimited: Linux's own cap (fs.nr_open)


@dataclass(frozen=True)
class OpenFiles:
    before: int  # the soft limit the process started with
    limit: int  # the soft limit now
    hard: int  # (resource.RLIM_INFINITY: unlimited)

    @property
    def relayed(self) -> int:
        """The relayed connections (answers, for the proxy) that fit at once."""
        return max(0, (self.limit - SPARE) // 2)

    def status(self) -> dict[str, int]:
        return {"limit": self.limit, "started_with": self.before, "answers_at_once": self.relayed}


def raise_open_files() -> OpenFiles:
    """Raise this process's soft limit on open files to its hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MOST if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return OpenFiles(soft, MOST if now == resource.RLIM_INFINITY else now, hard)


def raise_for_answers() -> OpenFiles:
    """`raise_open_files` for the proxy, saying what it did and what is still short."""
    files = raise_open_files()
    if files.limit > files.before:
        log.info("spillover: open files limit %d raised to %d", files.before, files.limit)
    if files.relayed < FEW_ANSWERS:
        hard = "unlimited" if files.hard == resource.RLIM_INFINITY else files.hard
        log.warning(
            "spillover: about %d answers at once fit in this process's open files limit "
            "(%d, hard limit %s): raise the hard limit for more (LimitNOFILE= in its "
            "service, ulimit -Hn where it starts)",
            files.relayed, files.limit, hard,
        )  # fmt: skip
    return files
