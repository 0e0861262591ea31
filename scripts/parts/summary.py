"""`spillover status` as a person reads it: the cards watched, the servers and their
states, the answers being carried and the last handoffs, from `GET /spillover/status`
(whose whole answer `spillover status --json` prints)."""

from __future__ import annotations

import time
from typing import Any

LAST_HANDOFFS = 5


def summary(status: dict[str, Any]) -> list[str]:
    return [
        *card_lines(status.get("memory") or {}),
        *server_lines(status),
        *answer_lines(status.get("live") or []),
        *handoff_lines(status.get("recent_handoffs") or []),
        *declined_lines(status.get("declined_handoffs") or {}),
    ]


def card_lines(memory: dict[str, Any]) -> list[str]:
    cards = memory.get("cards") or {}
    if not cards:
        said = "none" if memory.get("alive") else "none: the memory watcher is not running"
        return [f"cards: {said}"]
    lines = ["cards:"]
    for card, state in sorted(cards.items()):
        used, total = state.get("used_mib"), state.get("total_mib")
        if used is None:
            size = f"not read yet ({state['error']})" if state.get("error") else "not read yet"
        elif total:
            size = f"{used:,.0f} of {total:,.0f} MiB used, {total - used:,.0f} free"
        else:
            size = f"{used:,.0f} MiB used (total unknown)"
        fired = f"fired {state.get('fired') or 0} times"
        armed = f"armed ({fired})" if state.get("armed") else f"{fired}, not re-armed yet"
        lines.append(f"  {card}: {size}; {armed}")
        lines += [f"    {said}" for said in card_now(state)]
    return lines


def card_now(state: dict[str, Any]) -> list[str]:
    """What a card acts on now and since when, and who holds its memory (where its source
    says): for `status` and the live view."""
    said = []
    if state.get("state"):
        ago = state.get("since_s")
        when = "" if ago is None else f" ({ago:,.0f} s ago)"
        said.append(f"{state['state']}{when}; hands off on {state.get('acts_on')}")
    if (left := state.get("rearms_if_still_for_s")) is not None:
        said.append(f"re-arms at this level if it holds still {left:,.0f} s more")
    if holders := state.get("holders"):
        said.append(
            "held by: "
            + ", ".join(
                f"{h.get('name', '?')} {h['pid']}{' (a server)' if h.get('server') else ''} "
                f"{h['mib']:,.0f} MiB"
                for h in sorted(holders, key=lambda h: -h["mib"])
            )
        )
    return said


def server_lines(status: dict[str, Any]) -> list[str]:
    routing = status.get("routing") or {}
    live = routing.get("live_per_server") or {}
    fallbacks, infos = status.get("fallbacks") or [], status.get("servers") or {}
    mapping = (status.get("memory") or {}).get("servers") or {}
    lines = ["servers:"]
    for url, state in (routing.get("states") or {}).items():
        role = "fallback" if url in fallbacks else "primary"
        why = state_why(state)
        mapped = mapping.get(url) or {}
        cards = ", ".join(mapped.get("cards") or []) or "none known"
        if mapped.get("settled") is False:
            cards += " (a GPU source had not read yet: looked up again within a second)"
        lines.append(
            f"  {url} ({role}): {state.get('state', '?')}{why}; {engine(infos.get(url) or {})}; "
            f"cards: {cards}; {live.get(url, 0)} answers live"
        )
    return lines if len(lines) > 1 else ["servers: none known"]


def state_why(state: dict[str, Any]) -> str:
    """Why a server is in its state, and a /health slow for a loaded server's reason (it
    stays up), in parentheses; nothing where neither is said."""
    said = [state.get("why"), state.get("health") and f"/health {state['health']}"]
    return f" ({'; '.join(s for s in said if s)})" if any(said) else ""


def engine(info: dict[str, Any]) -> str:
    """Which engine a server is, and whether (and how) it continues an answer."""
    if not info.get("asked"):
        return "not asked yet"
    routes = f" (its own routes: {info['own_routes']})" if info.get("own_routes") else ""
    if info.get("continues"):
        return f"{info.get('engine')}{routes}, continues by {info.get('continues_by')}"
    return f"{info.get('engine')}{routes}, continues no answer that sent text"


def answer_lines(live: list[dict[str, Any]]) -> list[str]:
    lines = [f"answers live: {len(live)}"]
    for answer in live:
        lines.append(
            f"  {answer['flow'][:8]} {answer['api']} on {answer['server']}: "
            f"{answer['tokens']} tokens, {answer['handoffs']} handoffs"
        )
    return lines


def handoff_lines(recent: list[dict[str, Any]]) -> list[str]:
    if not recent:
        return ["last handoffs: none yet"]
    lines = ["last handoffs:"]
    for handoff in reversed(recent[-LAST_HANDOFFS:]):
        at = time.strftime("%H:%M:%S", time.localtime(handoff["at"]))
        paused = handoff.get("pause_ms")
        pause = f"first byte after {paused:.1f} ms" if paused is not None else "no byte yet"
        lines.append(
            f"  {at} {handoff['kind']} {handoff['source']} -> {handoff['target']} "
            f"after {handoff['at_token']} tokens, {pause}"
        )
    return lines


def declined_lines(declined: dict[str, Any]) -> list[str]:
    """Handoffs not made, the answer left where it was, and why the last ones were not."""
    counts = declined.get("counts") or {}
    if not counts:
        return []
    kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(counts.items()))
    lines = [f"handoffs declined: {sum(counts.values())} ({kinds})"]
    for entry in reversed((declined.get("recent") or [])[-LAST_HANDOFFS:]):
        at = time.strftime("%H:%M:%S", time.localtime(entry["at"]))
        lines.append(f"  {at} {entry['kind']} on {entry['server']}: {entry['why']}")
    return lines
