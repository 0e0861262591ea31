"""Card ids a person names (`spillover_cards`), checked against the cards the sources
report here, so a wrong one is refused at start rather than watched never.

NVIDIA cards are `nvml:N` in NVML's order (by PCI bus), which is not CUDA's (fastest
first) nor always the order a person counts in; `cuda:N` and a bare `N` are the usual
slips, and each is answered with what exists.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from watchers.exporters import REMOTE_PREFIX  # a remote card: known once Prometheus answers

CUDA = re.compile(r"^(?:cuda|gpu|device)[:=]?(\d+)$", re.IGNORECASE)


def unknown_cards(named: Mapping[str, set[str]], seen: Iterable[str]) -> list[str]:
    """One line for each card named for a server that no source reports here."""
    known = sorted(set(seen))
    said = []
    for server, cards in sorted(named.items()):
        for card in sorted(cards):
            if card in known or card.startswith(REMOTE_PREFIX):
                continue
            said.append(
                f"spillover_cards: {server}={card}: no card {card!r} here{_hint(card, known)}"
            )
    return said


def _hint(card: str, known: list[str]) -> str:
    exist = f" (cards here: {', '.join(known) or 'none'})"
    if (cuda := CUDA.match(card)) is not None:
        return (
            f"; cards are named by their source, NVIDIA ones as NVML numbers them "
            f"(nvml:N, by PCI bus, not CUDA's fastest-first order: `spillover doctor` says "
            f"which nvml:N is CUDA {cuda.group(1)})" + exist
        )
    if card.isdigit():
        close = [k for k in known if k.endswith(f":{card}") or k.endswith(f"card{card}")]
        if close:
            return f"; did you mean {' or '.join(close)}?" + exist
    return exist
