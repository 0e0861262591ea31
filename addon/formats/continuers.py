"""The ways a chat server is asked to go on with a partial assistant message.

Engines differ (../shared/FACTS.md section 6). llama-server, and any engine whose template
leaves a trailing assistant message open, continues it as sent. vLLM, SGLang, TGI and
TabbyAPI open a new turn after one unless the request also says
`continue_final_message: true` and `add_generation_prompt: false`. llama-cpp-python's
server always opens one, but continues a text completion of its own chat prompt, rendered
by the addon from the model's template, followed by the answer so far
(handoff/rendered.py). Which way a server takes is proven for each one
(servers/proof.py), never assumed from the primary.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Continuer:
    name: str
    fields: Mapping[str, Any] = field(default_factory=dict)  # what a continuation adds

    def ask(self, body: dict[str, Any]) -> dict[str, Any]:
        """`body` (a chat request ending in the partial message) asking to continue it."""
        return {**body, **self.fields}


TRAILING_MESSAGE = Continuer("a trailing assistant message")
FINAL_MESSAGE = Continuer(
    "continue_final_message",
    {"continue_final_message": True, "add_generation_prompt": False},
)
RENDERED = Continuer("a rendered prompt on /v1/completions")  # the request is remade
# llama-server whose template renders a trailing message otherwise than the model saw it:
# its own rendering of the request (`/apply-template`) and the answer, on `/completion`.
OWN_RENDERING = Continuer("a text completion of its own rendering on /completion")
CHAT_WAYS = (TRAILING_MESSAGE, FINAL_MESSAGE)
CONTINUERS = {way.name: way for way in (*CHAT_WAYS, RENDERED, OWN_RENDERING)}
