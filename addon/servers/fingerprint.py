"""Whether two servers compute an answer the same way, from measured evidence.

Moving an answer's KV state from one server to another (handoff/migration.py) is safe only when
both would have computed that state bit for bit alike: llama-server restores a slot saved
by another model of the same shape without complaint and uses it. So a fingerprint holds
what can be checked, not what is configured: the model file's content hash where the
addon can read the file (else the path the server reports), the context per slot, the
build, the chat template, the token ids of a fixed text, and the top log-probabilities of
a fixed prompt exactly as the server prints them (different weights, KV cache types or
kernels change them). It fails closed: a server that cannot be fingerprinted is
compatible with none.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from addon.servers.slots import idle_slots, unused_first

Ask = Callable[[str, Any], Awaitable[Any]]  # (path, JSON body or None) -> JSON answer
PROBE_TEXT = "Spillover probe: the quick brown fox, 1234567 über naïve café 東京."
PROBE_PROMPT = "<|im_start|>user\nName three rivers.<|im_end|>\n<|im_start|>assistant\n"
HASH_CHUNK = 8 * 1024 * 1024
_file_hashes: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256


@dataclass(frozen=True)
class Fingerprint:
    model: str  # "sha256:..." of the model file, or "path:..." as the server reports it
    slot_context: int
    build: str
    template: str
    tokens: str  # digest of the ids of PROBE_TEXT
    logits: str  # digest of the top log-probabilities of PROBE_PROMPT's next token

    def differences(self, other: Fingerprint) -> list[str]:
        return [
            field.name
            for field in dataclasses.fields(self)
            if getattr(self, field.name) != getattr(other, field.name)
        ]

    def as_status(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def file_sha256(path: str) -> str | None:
    """The file's SHA-256, remembered by path, size and modification time; None if the
    addon cannot read it (another host, or no permission). Slow for a big model: run it
    in a thread."""
    try:
        stat = os.stat(path)
        key = (path, stat.st_size, stat.st_mtime_ns)
        if key not in _file_hashes:
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(HASH_CHUNK):
                    digest.update(chunk)
            _file_hashes[key] = digest.hexdigest()
        return _file_hashes[key]
    except OSError:
        return None


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


async def take_fingerprint(ask: Ask) -> Fingerprint:
    """Ask a server for its fingerprint; raises (KeyError, TypeError, ValueError, or the
    client's own errors) when it cannot give one."""
    props = await ask("/props", None)
    model_path = str(props["model_path"])
    content = await asyncio.to_thread(file_sha256, model_path)
    ids = (await ask("/tokenize", {"content": PROBE_TEXT}))["tokens"]
    probe = await ask(
        "/completion",
        {
            "prompt": PROBE_PROMPT, "n_predict": 1, "n_probs": 8, "temperature": 0,
            "cache_prompt": False, "post_sampling_probs": False,
        },
    )  # fmt: skip
    top = probe["completion_probabilities"]
    if not top:
        raise ValueError("the probe returned no probabilities")
    return Fingerprint(
        model=f"sha256:{content}" if content else f"path:{model_path}",
        slot_context=int(props["default_generation_settings"]["n_ctx"]),
        build=str(props.get("build_info")),
        template=_digest(props.get("chat_template")),
        tokens=_digest(ids),
        logits=_digest(top),
    )


async def saves_into(ask: Ask, directory: Path) -> str | None:
    """Whether the server's saved slots land in `directory` (its --slot-save-path): it
    is asked to save an idle slot under a new name, which must appear there. None if so,
    otherwise why not."""
    slots = await ask("/slots", None)
    # An unused slot first: saving it writes a few bytes, not another client's cache.
    idle = [s["id"] for s in unused_first(idle_slots(slots))]
    if not idle:
        return "no idle slot to try a save with"
    name = f"spillover-check-{secrets.token_hex(8)}.bin"
    try:
        await ask(f"/slots/{idle[0]}?action=save", {"filename": name})
        if not (directory / name).exists():
            return f"its saved slots do not land in {directory} (--slot-save-path?)"
        return None
    finally:
        (directory / name).unlink(missing_ok=True)


async def fingerprint_for_migration(ask: Ask, directory: Path) -> Fingerprint | str:
    """The server's fingerprint, once it is known to save its slots into `directory`;
    otherwise why there is none."""
    try:
        fingerprint = await take_fingerprint(ask)
        why_not = await saves_into(ask, directory)
    except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError) as exc:
        return f"cannot be taken: {exc!r:.200}"
    return fingerprint if why_not is None else why_not
