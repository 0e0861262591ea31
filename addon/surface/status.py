"""What `GET /spillover/status` answers: servers, routing, live answers, and the status
other addons add (the memory watcher's cards)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from addon.answer.fleet import Fleet
from addon.answer.splice import Splice


def assemble_status(
    live: Mapping[str, Splice],
    fleet: Fleet,
    urls: Sequence[str],
    recent_handoffs: Sequence[dict[str, Any]],
    parts: Mapping[str, Callable[[], Any]],
) -> dict[str, Any]:
    """`live`: splices by flow; `urls`: every server of this proxy; `parts`: what
    other addons add, by name."""
    router, shadows = fleet.router, fleet.shadows.by_answer
    return {
        "pid": os.getpid(),  # which process answers (one of several workers, say)
        "fallbacks": [u.url for u in fleet.fallbacks],
        "routing": {
            "states": router.status(urls),
            "reroutes": dict(router.reroutes),
            "refusals": dict(router.refusals),
            "seconds_in": [
                {"server": url, "state": state, "seconds": round(seconds, 1)}
                for (url, state), seconds in router.seconds_in.items()
            ],
            "first_event_ms_per_byte": fleet.first_events.status(),
            "live_per_server": {
                url: sum(splice.current.url == url for splice in live.values()) for url in urls
            },
        },
        "servers": {u.url: i.as_status() for u, i in fleet.servers.info.items()},
        "live": [
            {
                "flow": flow_id,
                "api": splice.dialect.name,
                "server": splice.current.url,
                "tokens": splice.transcript.produced,
                "handoffs": len(splice.handoffs),
                "shadow": shadow.status() if (shadow := shadows.get(flow_id)) else None,
            }
            for flow_id, splice in live.items()
        ],
        "recent_handoffs": list(recent_handoffs),
        # Handoffs not made because no server could go on with the answer (answer/decide.py).
        "declined_handoffs": fleet.declines.status(),
        "shadows": fleet.shadows.budget.status(),
        "migration": fleet.migrator.status(),
        **{name: part() for name, part in parts.items()},
    }
