"""What a server makes of a prompt, asked of it: its rendering of a chat request (the
engines that render on asking), its tokens' count, and so the room a request takes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from addon.formats.continuation import token_limit
from addon.formats.rendering import rendering_request
from addon.servers import engines
from addon.servers.engines import ROUTER
from addon.servers.upstream import Upstream

Ask = Callable[[str, Any], Awaitable[Any]]  # (path, JSON body) -> the JSON answer


class Counted:
    """The token counts of texts as servers read them (by server, tokenizer and text):
    the latest few an answer's room checks asked or a shadow's prefill told. A text
    continuation's text grows with the answer, so each check may add one: only KEPT stay."""

    KEPT = 4

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str | None, str], int] = {}

    def get(self, key: tuple[str, str | None, str]) -> int | None:
        return self._counts.get(key)

    def put(self, key: tuple[str, str | None, str], count: int) -> None:
        self._counts.pop(key, None)
        self._counts[key] = count
        while len(self._counts) > self.KEPT:
            del self._counts[next(iter(self._counts))]


class NotRendered(Exception):
    """A server did not render a chat request; the message says why."""


async def rendered(ask: Ask, url: str, path: str, body: Any) -> Any:
    """The answer to a question that renders a chat request (llama-server's
    `/apply-template`, vLLM's `/tokenize`). Raises NotRendered, naming the cause."""
    try:
        return await ask(path, body)
    except httpx.ConnectError as exc:
        raise NotRendered(f"cannot connect to {url}: {exc!r}") from None
    except httpx.HTTPStatusError as exc:
        raise NotRendered(
            f"{url} did not render the request (HTTP {exc.response.status_code} from "
            f"{path}: {exc.response.text[:200]})"
        ) from None
    except (httpx.HTTPError, ValueError) as exc:
        raise NotRendered(f"{url} did not render the request ({exc!r})") from None


class PromptQuestions:
    """The questions of ServerDirectory about prompts (it provides `_ask`, `get` and
    `own_model`)."""

    async def count_tokens(self, upstream: Upstream, text: str) -> int | None:
        """How many tokens the server makes of `text` as a prompt."""
        try:
            return len(await self.prompt_ids(upstream, text))
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None

    async def prompt_ids(self, upstream: Upstream, text: str) -> list[int]:
        """The token ids a llama-server makes of `text` as a prompt, as its /completion
        does (special tokens added and parsed). Raises httpx.HTTPError, ValueError,
        KeyError or TypeError."""
        answer = await self._ask(upstream, "/tokenize", {"content": text, "add_special": True})
        tokens = answer["tokens"]
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise TypeError(f"not token ids: {str(tokens)[:100]}")
        return tokens

    async def _tokenized_chat(self, upstream: Upstream, body: dict[str, Any]) -> Any:
        """The answer of an engine whose tokenize route renders a chat request's messages
        (see engines.chat_tokenize_request), asked in the server's own model name; None
        where it has no such route or did not answer."""
        named = {**body, "model": self.own_model(upstream, body.get("model")) or body.get("model")}
        request = engines.chat_tokenize_request(self.get(upstream).engine or "", named)
        if request is None:
            return None
        try:
            return await self._ask(upstream, *request)
        except (httpx.HTTPError, ValueError):
            return None

    async def render(self, upstream: Upstream, body: dict[str, Any]) -> str | None:
        """`rendering`, or None where the server cannot say."""
        try:
            return await self.rendering(upstream, body)
        except NotRendered:
            return None

    async def rendering(self, upstream: Upstream, body: dict[str, Any]) -> str:
        """The chat request's prompt as this server's template renders it, with all of
        the request that reaches the template (formats/rendering.py): a llama-server's own
        `/apply-template`, a router's for the model it serves. Raises NotRendered."""
        request = rendering_request(body)
        if self.get(upstream).engine == ROUTER:
            request["model"] = self.own_model(upstream, body.get("model")) or body.get("model")
        answer = await rendered(
            lambda path, body: self._ask(upstream, path, body), upstream.url, "/apply-template",
            request,
        )  # fmt: skip
        prompt = answer.get("prompt") if isinstance(answer, dict) else None
        if not isinstance(prompt, str):
            raise NotRendered(f"{upstream.url} did not render the request (no prompt)")
        return prompt

    async def room_needed(
        self,
        upstream: Upstream,
        body: dict[str, Any],
        room: int,
        bound: int | None,
        counted: Counted,
    ) -> int | None:
        """Tokens the request takes on this server: its rendered prompt plus the tokens it
        may still write; None when the server cannot tell. When `bound` (from its size)
        says it fits in `room`, the server is not asked (asking costs two round trips in
        the pause). `counted`: the token counts of texts this server was asked already
        (an answer's, by server, tokenizer and text), kept there: the prompt a handoff
        replays, asked of its target before the cut, is not asked again in the pause."""
        if bound is not None and bound <= room:
            return bound
        if (
            counted_chat := engines.prompt_count(await self._tokenized_chat(upstream, body))
        ) is not None:
            return counted_chat + (token_limit(body) or 0)
        prompt = body.get("prompt")
        if prompt is None and (prompt := await self.render(upstream, body)) is None:
            return None
        count = 0
        for part in prompt if isinstance(prompt, list) else [prompt]:
            if isinstance(part, int):
                count += 1
                continue
            if (known := self.kept_count(counted, upstream, part)) is None:
                try:
                    tokens = await self._ask(upstream, "/tokenize", {"content": part})
                    known = len(tokens["tokens"])
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    return None
                self.keep_count(counted, upstream, part, known)
            count += known
        return count + (token_limit(body) or 0)

    def keep_count(self, counted: Counted, upstream: Upstream, text: str, count: int) -> None:
        """Keep in `counted` the tokens `upstream` makes of `text`, for `room_needed`."""
        counted.put(self._count_key(upstream, text), count)

    def kept_count(self, counted: Counted, upstream: Upstream, text: str) -> int | None:
        """The tokens `upstream` makes of `text`, where `counted` keeps them."""
        return counted.get(self._count_key(upstream, text))

    def _count_key(self, upstream: Upstream, text: str) -> tuple[str, str | None, str]:
        # By its tokenizer too: a server learnt again with another model counts afresh.
        return upstream.url, self.get(upstream).tokenizer, text
