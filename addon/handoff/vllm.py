"""vLLM's terms. Its `/tokenize` renders a chat request with its own template (tools,
kwargs, `continue_final_message` and all) into token ids, and `/detokenize` gives their
text: what its model saw is those ids of the original request, and a trailing message
is compared with the truth as ids too. Its text route (`/v1/completions`) takes a
prompt of ids.

Where it serves its own routes (servers/vllm_routes.py), what its model saw is its render
route's ids of the request as sent, and a continuation is the truth's ids through its
generate route, read by its own parsers (handoff/vllm_generate.py): nothing to compare.

Between two vLLM servers of one tokenizer an answer goes on from its very token ids:
the first leg is asked for them (`return_token_ids`, taken out again unless the client
asked for them). vLLM holds back text (half of a character, the start of a stop string)
while its ids go out: the transcript treats ids whose text has not arrived as unknown
(fail closed), and an answer with stop strings is replayed as text.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from addon.formats.continuation import ChunkRewriter, token_limit
from addon.formats.rendering import parting_at
from addon.formats.transcript import Transcript
from addon.handoff import specials
from addon.handoff.builder import Leg, Prompt
from addon.handoff.rendered import PATH, CompletionRewriter, logprobs_asked, text_completion
from addon.handoff.vllm_generate import Derendered, generate_body
from addon.servers.engines import CHAT_RENDERING
from addon.servers.prompts import Ask, NotRendered, rendered
from addon.servers.vllm_routes import GENERATE, RENDER

ENGINE = "vllm"
# Chat request fields its chat route renders and its `/tokenize` does not (it drops them).
NOT_TOKENIZED = ("documents", "reasoning_effort")
SHOWN = 4  # ids shown on each side of where two prompts part


def may_ask_for_ids(body: dict[str, Any]) -> bool:
    """Whether asking for ids changes nothing the client decides: it did not set
    `return_token_ids` itself, and no stop string makes vLLM hold text back."""
    return "return_token_ids" not in body and not body.get("stop")


def client_wants_ids(body: dict[str, Any]) -> bool:
    return body.get("return_token_ids") is True


def asking_for_ids(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "return_token_ids": True}


def native_body(
    body: dict[str, Any], prompt: list[int], produced: int, context: int
) -> dict[str, Any]:
    """A text completion that goes on from `prompt` (the chat prompt's ids, then the
    answer's), with the chat request's sampling settings. Where the client set no limit,
    the rest of the server's `context`: vLLM's text route reads a null `max_tokens` as
    its default, 16 tokens, where its chat route goes on to the end of the context."""
    limit = token_limit(body)
    left = context - len(prompt) if limit is None else max(1, limit - produced)
    native = text_completion(body, prompt, max(1, left))
    native.pop("return_token_ids", None)
    return native


class VllmTerms:
    def __init__(
        self,
        url: str,
        ask: Ask,
        model: str | None,
        original: dict[str, Any],
        transcript: Transcript,
        context: int | None,
        routes: bool = False,
        ids: bool = False,
        dated: Callable[[], Awaitable[str | None]] | None = None,
    ) -> None:
        """`model`: the name it serves its model by; `context`: its tokens per request,
        where known (a text completion is not sent without it); `routes`: it serves its
        own render, generate and derender routes (servers/vllm_routes.py); `ids`: the
        answer's chunks carry their token ids (taken out again where the client did not
        ask), which a leg through those routes then asks its derender for too; `dated`:
        the first server's rendering as the answer began, where its template is this
        one's and prints the date (handoff/renderings.py), which it goes on from."""
        self.url = url
        self._ask = ask
        self._named = {"model": model} if model else {}
        self._original = original
        self._transcript = transcript
        self._context = context
        # Its render of the original request, where it serves its own routes (else None).
        self._rendered: dict[str, Any] | None = {} if routes else None
        self._ids = {"return_token_ids": True} if ids else {}
        self._dated = dated

    async def saw(self) -> Prompt:
        dated = await self._dated() if self._dated is not None else None
        if self._rendered is not None:
            self._rendered = await self._asked(RENDER, {**self._original, **self._named})
            if dated is not None:  # the day the model read, not this server's own
                self._rendered["token_ids"] = await self._text_ids(dated)
            return Prompt(ids=tuple(_ids(self._rendered, "token_ids")))
        if dated is not None:
            return Prompt(ids=tuple(await self._text_ids(dated)))
        if unrendered := [name for name in NOT_TOKENIZED if self._original.get(name)]:
            raise NotRendered(
                f"{self.url}'s /tokenize does not render {' or '.join(unrendered)} as its chat "
                "route does (its render route would: vLLM 0.32 and later, --enable-scale-out)"
            )
        # As its chat route read the request: the generation prompt on unless it said
        # otherwise (a client prefill asks `continue_final_message` without it).
        opened = {"add_generation_prompt": True, **self._original}
        return Prompt(ids=tuple(await self._chat_ids(opened)))

    async def truth(self, saw: Prompt, written: str) -> Prompt:
        """The text of `saw` (its `/detokenize`, checked to read back as the same ids)
        followed by `written`, as its text route tokenizes it."""
        ids = list(saw.ids or ())
        text = (await self._asked("/detokenize", {**self._named, "tokens": ids}))["prompt"]
        if not isinstance(text, str) or await self._text_ids(text) != ids:
            raise NotRendered(
                f"{self.url} does not read the text of its own rendering of the request "
                "as the same token ids: it cannot be continued by text there"
            )
        return Prompt(text=text + written, ids=tuple(await self._text_ids(text + written)))

    async def spelled(self, text: str) -> str | None:
        """Its `/tokenize` reads every added token in a text: asked which it has."""
        return await specials.refusal(ENGINE, self._ask, self.url, self._named.get("model"), text)

    async def reads(self, chat: dict[str, Any]) -> Prompt:
        return Prompt(ids=tuple(await self._chat_ids(chat)))

    def parting(self, read: Prompt, truth: Prompt) -> str | None:
        if read.ids == truth.ids:
            return None
        seen, sent = truth.ids or (), read.ids or ()
        at = parting_at(seen, sent)
        start = max(0, at - SHOWN)
        return (
            f"at token {at} the model saw ids {list(seen[start : at + SHOWN])}, a trailing "
            f"message reads {list(sent[start : at + SHOWN])}"
        )

    def text_leg(self, truth: Prompt) -> Leg | None:
        return self._completion(list(truth.ids or ()))

    def ids_leg(self, saw: Prompt, ids: list[int]) -> Leg | None:
        prompt = [*(saw.ids or ()), *ids]
        return self._generated(prompt) if self._rendered else self._completion(prompt)

    def parsed_leg(self, truth: Prompt) -> Leg | None:
        """The truth's ids on its own routes, read by its own parsers (None without them)."""
        return self._generated(list(truth.ids or ())) if self._rendered else None

    def _generated(self, prompt: list[int]) -> Leg | None:
        # Its generate route leaves a matched stop string in the ids its derender reads
        # (its chat route cuts it from the text): such an answer goes on the other ways.
        if self._context is None or not self._rendered or self._original.get("stop"):
            return None
        limit = token_limit(self._original)
        left = self._context - len(prompt) if limit is None else limit - self._transcript.produced
        body = generate_body(self._rendered, prompt, max(1, left))
        plain = ChunkRewriter(self._transcript, "", False)
        original = {**self._original, **self._named, **self._ids}
        asked = len(self._rendered["token_ids"])
        named = self._named.get("model")
        return GENERATE, body, Derendered(self._ask, named, original, prompt, plain, asked)

    def _completion(self, prompt: list[int]) -> Leg | None:
        if self._context is None:
            return None
        body = native_body(self._original, prompt, self._transcript.produced, self._context)
        plain = ChunkRewriter(self._transcript, "", False)
        return PATH, body, CompletionRewriter(plain, logprobs_asked(self._original))

    async def _chat_ids(self, chat: dict[str, Any]) -> list[int]:
        request = {name: chat[name] for name in CHAT_RENDERING if name in chat}
        return _ids(await self._asked("/tokenize", {**self._named, **request}))

    async def _text_ids(self, text: str) -> list[int]:
        request = {**self._named, "prompt": text, "add_special_tokens": False}
        return _ids(await self._asked("/tokenize", request))

    async def _asked(self, path: str, body: dict[str, Any]) -> Any:
        return await rendered(self._ask, self.url, path, body)


async def rendered_text(ask: Ask, url: str, model: str | None, body: dict[str, Any]) -> str:
    """A vLLM's rendering of a chat request as text: its ids of it, their text, checked to
    read back as the same ids. Raises NotRendered."""
    terms = VllmTerms(url, ask, model, body, Transcript(), None)
    return (await terms.truth(await terms.saw(), "")).text or ""


def _ids(answer: Any, name: str = "tokens") -> list[int]:
    tokens = answer.get(name) if isinstance(answer, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise NotRendered(f"no token ids in its answer: {answer!r:.200}")
    return tokens
