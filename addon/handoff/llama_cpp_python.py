"""llama-cpp-python's terms. Its chat route opens a new turn after a trailing assistant
message, and no route of it renders a chat on asking; but its chat route renders with
the model's own template in a jinja2 environment the addon mirrors (formats/template.py;
tests/test_template_engines.py compares the two on every template llama.cpp ships), and
the template is proven the one it reads at start-up (servers/proof.py). What its model
saw is that rendering of the original request (messages and tools as sent: it takes no
per-request template kwargs); a continuation is a text completion of it followed by
what the model wrote (handoff/rendered.py)."""

from __future__ import annotations

from typing import Any

from addon.formats.continuation import ChunkRewriter, token_limit
from addon.formats.template import ChatTemplate, NoTemplate
from addon.formats.transcript import Transcript
from addon.handoff import seen, specials
from addon.handoff.builder import Leg, Prompt
from addon.handoff.rendered import PATH, CompletionRewriter, logprobs_asked, text_completion
from addon.servers.prompts import NotRendered


class LlamaCppPythonTerms:
    def __init__(
        self,
        url: str,
        template: ChatTemplate,
        original: dict[str, Any],
        continued: dict[str, Any],
        transcript: Transcript,
        ask: specials.Ask,
    ) -> None:
        """`continued`: the chat continuation, whose settings (limits lowered) a text
        completion takes; `ask`: its own questions."""
        self.url = url
        self._template = template
        self._original = original
        self._continued = continued
        self._transcript = transcript
        self._ask = ask

    async def saw(self) -> Prompt:
        messages = list(self._original["messages"])
        try:
            return Prompt(text=self._template.render(messages, tools=self._original.get("tools")))
        except NoTemplate as exc:
            raise NotRendered(f"{self.url}: {exc}") from None

    async def truth(self, saw: Prompt, written: str) -> Prompt:
        return Prompt(text=(saw.text or "") + written)

    async def spelled(self, text: str) -> str | None:
        return await specials.refusal("llama-cpp-python", self._ask, self.url, None, text)

    async def reads(self, chat: dict[str, Any]) -> None:
        return None

    def parting(self, read: Prompt, truth: Prompt) -> str | None:
        return seen.parting(read.text or "", truth.text or "")

    def text_leg(self, truth: Prompt) -> Leg:
        continued = self._continued
        body = text_completion(continued, truth.text or "", token_limit(continued))
        plain = ChunkRewriter(self._transcript, "", False)
        return PATH, body, CompletionRewriter(plain, logprobs_asked(self._original))

    def ids_leg(self, saw: Prompt, ids: list[int]) -> None:
        return None
