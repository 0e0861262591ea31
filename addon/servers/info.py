"""What the addon knows of one server (servers/directory.py asks it), and what an
unanswered question turns off."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import httpx

from addon.servers.fingerprint import Fingerprint
from addon.servers.upstream import Upstream

log = logging.getLogger(__name__)


# What a server's unanswered question turns off.
NEEDED_FOR = {
    "/props": "room checks (its context per slot is unknown)",
    "/v1/models": "knowing its model and tokenizer (token-exact replay)",
    "/tokenize": "token-exact replay (its tokenizer is unknown)",
    "/v1/chat/completions": "knowing whether it echoes a prefill (decided from its answer)",
    "/tokenizer_info": "keeping the date its chat template may print (the template is not known)",
}


@dataclass
class ServerInfo:
    engine: str | None = None
    models: list[str] = field(default_factory=list)
    # Whether it continues a partial assistant message (None: not known, so no), the way
    # it is asked to (formats/continuers.py), and how that is known (proof.py).
    continues: bool | None = None
    continues_by: str | None = None
    continues_why: str = "not checked yet"
    # Its way of continuing drops an answer's trailing whitespace (proof.py).
    trims_whitespace: bool = False
    # How it is known to continue: "engine" (its own routes say what it reads, or count
    # it), "behaviour" (a probe through its chat route alone: servers/behaviour.py) or
    # "declared" (its operator's word, spillover_continue_by, not proven).
    proof: str | None = None
    declared: str | None = None  # the way its operator declared
    probe_disagrees: str | None = None  # what the check found where it was declared
    settled: bool = False  # it answered; what is not known by now is not asked again
    asked: bool = False  # every start-up question has been answered, or has failed
    echoes_prefill: bool | None = None
    template_from: str | None = None  # where its chat template was read (or why not)
    # Its chat template's digest where that template prints the date (identity.py).
    dated_template: str | None = None
    slot_context: int | None = None
    tokenizer: str | None = None
    # vLLM's own render, generate and derender routes: whether it serves them
    # (servers/vllm_routes.py).
    own_routes: str | None = None
    model: str | None = None
    identity: str | None = None  # what it said it runs when this was learnt (identity.py)
    # Questions it did not answer: {path: "why; what that turns off"}.
    unanswered: dict[str, str] = field(default_factory=dict)
    # It turned a question away for want of a key (HTTP 401 or 403): it judges clients.
    wants_key: bool = False
    # With spillover_slot_dir: what it computes (fingerprint.py), or why that is unknown.
    fingerprint: Fingerprint | str | None = None

    def as_status(self) -> dict[str, Any]:
        status = dict(vars(self))
        if isinstance(self.fingerprint, Fingerprint):
            status["fingerprint"] = self.fingerprint.as_status()
        return status


def unanswered(upstream: Upstream, info: ServerInfo, path: str, exc: Exception) -> None:
    status = exc.response.status_code if isinstance(exc, httpx.HTTPStatusError) else None
    why = f"HTTP {status}" if status is not None else repr(exc)
    info.wants_key = info.wants_key or status in (401, 403)
    info.unanswered[path] = f"{why}; turns off {NEEDED_FOR[path]}"
    log.info("%s: no answer to %s: %s", upstream.url, path, info.unanswered[path])


def slot_context(props: Any) -> int | None:
    """The context per slot a llama-server's `/props` says (0, a router's: unknown)."""
    return int(props["default_generation_settings"]["n_ctx"]) or None
