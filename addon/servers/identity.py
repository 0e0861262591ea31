"""Which server answers at an address: what the proofs rest on, to tell when it changed.

A server proven at start-up can be restarted on the same port with another model, and a
balancer's replicas can differ: the proofs (how it continues, its tokenizer, its context,
its echo) then describe a server that is gone. What the engine says of its model and its
build (llama-server's `/props`, every engine's `/v1/models`) is kept as the server's
identity, and asked again when the server may have changed: when it answers again after
being down, and right before a continuation is sent there (servers/directory.py).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from addon.formats.shape import mapping

# What llama-server's /props says of the model and build it runs (not its live state).
PROPS = ("model_path", "build_info", "chat_template", "bos_token", "eos_token", "total_slots")
# What each /v1/models entry says of a model ("created" is the time of the answer).
MODEL = ("id", "root", "owned_by", "max_model_len", "meta")


def identity_of(props: Any, models: Any) -> str | None:
    """A fingerprint of what the server says it runs; None when it says nothing."""
    if props is None and models is None:
        return None
    said = {name: mapping(props).get(name) for name in PROPS}
    said["n_ctx"] = mapping(mapping(props).get("default_generation_settings")).get("n_ctx")
    entries = mapping(models).get("data")
    said["models"] = [
        {name: mapping(entry).get(name) for name in MODEL}
        for entry in (entries if isinstance(entries, list) else [])
    ]
    return _digest(json.dumps(said, sort_keys=True, default=str))


DATE_CALLS = ("strftime_now",)  # what llama.cpp's and vLLM's templates call for the date


def dated_template(props: Any) -> str | None:
    """The digest of a server's chat template (a llama-server's `/props`, a vLLM's
    `/tokenizer_info`) where that template prints the date (handoff/renderings.py); None
    where it does not, or is not said."""
    template = mapping(props).get("chat_template")
    if not isinstance(template, str) or not any(call in template for call in DATE_CALLS):
        return None
    # Jinja drops a template's last newline, which llama-server strips as it loads one
    # and vLLM keeps: the same file renders the same on both.
    return _digest(template.removesuffix("\n"))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
