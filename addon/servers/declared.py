"""How a server continues a partial answer by its operator's word
(`spillover_continue_by`), for servers the addon cannot prove: a hosted API, LM Studio, a
gateway. The declaration stands over what the start-up check found (some servers cannot
count but do continue); where the two disagree, the log and the status say so. A
declared server is asked by text only, never token ids, and each continuation's first
words are checked (formats/startover.py); the note, the status and the metrics say
"declared, not proven"."""

from __future__ import annotations

import logging

from mitmproxy import exceptions

from addon.formats.continuers import FINAL_MESSAGE, TRAILING_MESSAGE, Continuer
from addon.servers.credentials import url_pairs
from addon.servers.info import ServerInfo

log = logging.getLogger(__name__)

# A declaration: the way a continuation is asked, and whether the server echoes the
# partial message before going on.
WAYS: dict[str, tuple[Continuer, bool]] = {
    "message": (TRAILING_MESSAGE, False),
    "message-echoed": (TRAILING_MESSAGE, True),
    "final-message": (FINAL_MESSAGE, False),
}


def parse_ways(option: str) -> dict[str, str]:
    """`URL=WAY,...` (spillover_continue_by) as {URL: WAY}; a way not in WAYS is refused."""
    ways = url_pairs(option, "spillover_continue_by", "WAY")
    for url, way in ways.items():
        if way not in WAYS:
            raise exceptions.OptionsError(
                f"spillover_continue_by: {url}={way}: the way is one of {', '.join(WAYS)}"
            )
    return ways


def declare(url: str, info: ServerInfo, way_name: str) -> None:
    """`info` as its operator declares it continues; the check's own finding is kept
    where it disagrees."""
    way, echoes = WAYS[way_name]
    agrees = (
        info.continues is True and info.continues_by == way.name
        and (info.echoes_prefill is None or info.echoes_prefill == echoes)
    )  # fmt: skip
    found = info.continues_why
    info.declared = way_name
    info.continues, info.continues_by, info.echoes_prefill = True, way.name, echoes
    if agrees:
        info.continues_why = f"{found}; declared too ({way_name})"
        return
    info.proof = "declared"
    info.probe_disagrees = found
    info.continues_why = f"declared by its operator: {way_name} (declared, not proven)"
    log.warning(
        "spillover: %s is declared to continue by %s, but the check disagrees: %s",
        url, way_name, found,
    )  # fmt: skip
