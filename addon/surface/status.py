"""What `GET /spillover/status` answers: servers, routing, live answers, and the status
other addons add (the memory watcher's cards)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from addon.surface.proxy import Spillover


def assemble_status(spillover: Spillover) -> dict[str, Any]:
    live = spillover.live
    for answer in live.values():
        answer.splice.transcript.settle()
    router, urls = spillover.router, spillover.server_urls()
    shadows = spillover.shadows.by_answer
    return {
        "fallbacks": [u.url for u in spillover.fallbacks],
        "routing": {
            "states": router.status(urls),
            "reroutes": dict(router.reroutes),
            "seconds_in": [
                {"server": url, "state": state, "seconds": round(seconds, 1)}
                for (url, state), seconds in router.seconds_in.items()
            ],
            "live_per_server": {
                url: sum(answer.splice.current.url == url for answer in live.values())
                for url in urls
            },
        },
        "servers": {u.url: i.as_status() for u, i in spillover.servers.info.items()},
        "live": [
            {
                "flow": flow_id,
                "api": answer.splice.dialect.name,
                "server": answer.splice.current.url,
                "tokens": answer.splice.transcript.produced,
                "handoffs": len(answer.splice.handoffs),
                "shadow": shadow.status() if (shadow := shadows.get(flow_id)) else None,
            }
            for flow_id, answer in live.items()
        ],
        "recent_handoffs": list(spillover.metrics.recent),
        "shadows": spillover.shadows.budget.status(),
        "migration": spillover.migrator.status(),
        **{name: part() for name, part in spillover.status_parts.items()},
    }
