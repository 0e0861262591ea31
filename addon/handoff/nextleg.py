"""How the next server on the ladder is asked to go on with an answer."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from addon.formats.continuation import prefill_of
from addon.formats.continuers import CONTINUERS, RENDERED
from addon.formats.dialect import Dialect, Rewriter
from addon.formats.shape import dumps
from addon.formats.startover import COMPARED, StartOverGuard, checkable
from addon.formats.transcript import Transcript
from addon.handoff import known, media, seen, specials, translated, vllm
from addon.handoff.builder import UNSEEN, Answer, CannotContinue, Leg, Terms, build
from addon.handoff.exact import NativeRewriter, asking_for_ids, may_ask_for_ids
from addon.handoff.known import UNPROVEN, parses
from addon.handoff.llama_cpp_python import LlamaCppPythonTerms
from addon.handoff.llama_server import LlamaServerTerms
from addon.handoff.record import Handoff, seeded_sampling
from addon.handoff.renderings import Renderings
from addon.handoff.sampling import sampled_as_first
from addon.handoff.vllm import VllmTerms
from addon.servers.directory import ServerDirectory
from addon.servers.engines import RENDERS_ON_ASKING, ROUTER
from addon.servers.prompts import Counted, NotRendered
from addon.servers.upstream import Upstream


def rerouted(body: dict[str, Any], raw_body: bytes, model: str | None) -> bytes:
    """The client's body for a server other than the primary: without `id_slot` (the
    client named one of the primary's slots; elsewhere that slot may be running another
    answer, which a pinned request would change: see handoff/shadow.py), and naming the
    server's own `model` where it has to (see ServerDirectory.own_model)."""
    if "id_slot" not in body and model is None:
        return raw_body
    moved = json.loads(raw_body)
    moved.pop("id_slot", None)
    if model is not None:
        moved["model"] = model
    return json.dumps(moved).encode()


class NextLeg:
    """Builds continuation requests for one answer: from its token ids when the next
    server reads them the same way, else from its text; only for a server it fits on."""

    def __init__(
        self,
        path: str,
        dialect: Dialect,
        body: dict[str, Any],
        transcript: Transcript,
        servers: ServerDirectory | None,
        asks_ids: bool,
    ) -> None:
        self.path = path
        self.dialect = dialect
        self.body = body
        self.transcript = transcript
        self._servers = servers
        self.asks_ids = asks_ids
        self._counted = Counted()  # for the answer's room checks (see room_needed)
        self.renderings = None if servers is None else Renderings(servers, body, self._counted)

    async def request(
        self,
        upstream: Upstream,
        handoff: Handoff,
        restored: bool = False,
        on_reading: Callable[[dict[str, Any]], None] | None = None,
    ) -> tuple[str, bytes, Rewriter] | str:
        """The request that continues the answer on `upstream` (path, body and how to
        rewrite its chunks), or why it cannot take it. `restored`: a slot of the server
        holds most of it (a migration's); the request names no slot, and the server's
        own choice among idle slots finds it (see shadow.py); `on_reading` is then given
        the timings of its first token (what it took from its cache, what it read)."""
        try:
            path, body, rewriter, handoff.replay = await self.continuation(upstream)
            handoff.proof = self._unproven(upstream) if handoff.replay else None
        except CannotContinue as why:
            return str(why)
        if handoff.replay and seeded_sampling(self.body):
            handoff.caveat = "the sampling seed starts over on the new server"
        if (no_room := await self._no_room(upstream, body)) is not None:
            return no_room
        if restored:
            body["cache_prompt"] = True
            if on_reading is not None and isinstance(rewriter, NativeRewriter):
                body["timings_per_token"] = True
                rewriter.on_reading = on_reading
        return path, dumps(body), rewriter

    async def continuation(
        self, upstream: Upstream
    ) -> tuple[str, dict[str, Any], Rewriter, str | None]:
        """(path, body, chunk rewriter, how it replays) of the continuation as the answer
        stands: built from what the model saw and wrote where `upstream`'s engine can say
        what it reads (handoff/builder.py), else the dialect's continuation, the way the
        server was proven to take one at start-up. Raises CannotContinue."""
        if (why := self.refusal(upstream)) is not None:
            raise CannotContinue(why)
        # What the checks below hold the continuation to, while the leg goes on.
        standing = self.transcript.standing()
        if (terms := self._terms(upstream)) is not None:
            answer = Answer(
                standing, prefill_of(self.body) or "", self._text_continuation(upstream),
                bool(self.body.get("tools")), lambda chat: self._chat_leg(upstream, chat),
            )  # fmt: skip
            ids = standing.ids if self._exact_ids(upstream) is not None else None
            (path, body, rewriter), replay = await build(terms, answer, ids)
        else:
            path, body, rewriter, replay = self._dialect_leg(upstream)
        body.pop("id_slot", None)  # the client's, one of the primary's (see `rerouted`)
        body = sampled_as_first(self._servers, self.body, body, self.transcript, upstream)
        if self._servers and (own := self._servers.own_model(upstream, body.get("model"))):
            body["model"] = own
        if terms is None and replay and self._checked_as_chat(upstream):
            await self._check_as_chat(upstream, body, standing)
        elif terms is None and replay:
            await self._check_spelled(upstream, body.get("model"))
        return path, body, rewriter, replay

    def refusal(self, upstream: Upstream) -> str | None:
        """Why `upstream` may not go on with this answer as it stands, known without
        asking it (handoff/known.py); None where nothing known turns it away."""
        if self._servers is None:
            return None
        exact = self._exact_ids(upstream) is not None
        return known.refusal(self._servers, self.body, self.transcript, upstream, exact)

    @property
    def said(self) -> bool:
        """Whether the answer has sent anything: its continuation is then built from it,
        asking the next server what it reads where it can say, and whether that server
        may go on is known only once it is built (`asked_refusal`)."""
        return bool(self.transcript.content or self.transcript.reasoning)

    async def asked_refusal(self, upstream: Upstream) -> str | None:
        """Why `upstream` may not go on with this answer as it stands: its continuation
        built, the server asked what it must be asked, and whether it has room for it
        (None: it may)."""
        try:
            _, body, _, _ = await self.continuation(upstream)
        except CannotContinue as why:
            return str(why)
        return await self._no_room(upstream, body)

    def _dialect_leg(self, upstream: Upstream) -> tuple[str, dict[str, Any], Rewriter, str | None]:
        """The dialect's continuation on `upstream`, whose engine cannot say what it reads,
        and how it replays. Raises CannotContinue."""
        if self.transcript.content and self.transcript.raw_lost:
            raise CannotContinue(UNSEEN.format(self.transcript.unseen))
        path, body, rewriter = self._chat_leg(upstream, self._text_continuation(upstream))
        replay = "text" if self.transcript.content or self.transcript.reasoning else None
        if replay and (proof := self._unproven(upstream)) is not None:
            replay += f", {UNPROVEN[proof]}"
            rewriter = self._first_words_held(upstream, rewriter, proof)
        return path, body, rewriter, replay

    def _first_words_held(self, upstream: Upstream, rewriter: Rewriter, proof: str) -> Rewriter:
        """`rewriter` holding the continuation's first words on `upstream`, which cannot be
        asked what it reads, until they show it went on (formats/startover.py). Raises
        CannotContinue where they cannot show it: another API's events, or an answer too
        short to tell a continuation from the answer started over."""
        if self.dialect.name != "chat":
            why = f"first words are checked in chat answers only, not {self.dialect.name}"
        elif not checkable(self.transcript.text):
            why = f"the answer so far is under {COMPARED} characters: too short to check"
        else:
            return StartOverGuard(rewriter, self.transcript.text, upstream.url)
        raise CannotContinue(f"{upstream.url} is {UNPROVEN[proof]}, and {why}")

    def _checked_as_chat(self, upstream: Upstream) -> bool:
        """Whether this answer's continuation on `upstream` is checked as the chat request
        its API's route makes of it (a Messages or Responses answer, on a llama-server
        proven by its routes: handoff/translated.py)."""
        info = self._servers.get(upstream) if self._servers else None
        return (
            info is not None
            and self.dialect.name in translated.CHECKED
            and info.engine in RENDERS_ON_ASKING
            and info.proof == "engine"
        )

    async def _check_as_chat(
        self, upstream: Upstream, body: dict[str, Any], standing: Transcript
    ) -> None:
        """Raises CannotContinue where `upstream` would not read `body` as exactly what
        the model saw and wrote, as `standing` has it (handoff/translated.py)."""
        servers = self._servers
        assert servers is not None
        await translated.check(
            self.dialect.name, upstream.url, lambda chat: servers.rendering(upstream, chat),
            servers.asker(upstream), self.body, body, standing,
            router=servers.get(upstream).engine != "llama-server",
        )  # fmt: skip

    async def _check_spelled(self, upstream: Upstream, model: str | None) -> None:
        """Raises CannotContinue where `upstream` may read what the model wrote, sent as
        text, as one of its special tokens (handoff/specials.py)."""
        servers, wrote = self._servers, seen.delivered_written(self.body, self.transcript)
        info = servers.get(upstream) if servers else None
        for text in (self.transcript.reasoning_text, wrote):
            if servers is None or info is None or info.proof != "engine":  # routes hidden
                why = specials.unaskable(upstream.url, text, "its engine's routes cannot be asked")
            else:
                ask = servers.asker(upstream)
                why = await specials.refusal(info.engine, ask, upstream.url, model, text)
            if why is not None:
                raise CannotContinue(why)

    def _first_engine(self) -> str | None:
        """The engine of the server that wrote the answer's first leg."""
        if self._servers is None or not self.transcript.legs:
            return None
        return self._servers.get(Upstream(self.transcript.legs[0].server)).engine

    def _unproven(self, upstream: Upstream) -> str | None:
        """How `upstream` is known to continue where its engine cannot say what it reads
        ("behaviour" or "declared"); None where it can."""
        return known.unproven(self._servers.get(upstream)) if self._servers else None

    def _terms(self, upstream: Upstream) -> Terms | None:
        """`upstream`'s engine's terms for what its model reads, where it can say them
        and the answer has sent something to go on from (a chat answer: the other APIs'
        continuations go as their own dialects make them); None otherwise."""
        servers, renderings = self._servers, self.renderings
        if servers is None or renderings is None or self.dialect.name != "chat":
            return None
        if not isinstance(self.body.get("messages"), list):
            return None
        if not (self.transcript.content or self.transcript.reasoning):
            return None
        info, url = servers.get(upstream), upstream.url
        if info.proof != "engine":
            return None  # its engine's routes did not prove it: they may be hidden
        if info.engine in RENDERS_ON_ASKING:
            render = lambda chat: servers.rendering(upstream, chat)  # noqa: E731
            saw = lambda: self._chat_prompt_or_why(upstream)  # noqa: E731
            ids_of = lambda text: renderings.ids_of(upstream, text)  # noqa: E731
            asker, routed = servers.asker(upstream), info.engine == ROUTER
            return LlamaServerTerms(url, info.model, self.body, self.transcript, saw, render,
                                    asker, ids_of, routed)  # fmt: skip
        if info.engine == vllm.ENGINE:
            model = servers.own_model(upstream, self.body.get("model")) or self.body.get("model")
            ids = self.asks_ids and self._first_engine() == vllm.ENGINE
            dated = lambda: renderings.dated(upstream)  # noqa: E731
            return VllmTerms(url, servers.asker(upstream), model, self.body, self.transcript,
                             info.slot_context, parses(info), ids, dated)  # fmt: skip
        if info.continues_by == RENDERED.name and (template := servers.templates.get(upstream)):
            continued = self._text_continuation(upstream)
            return LlamaCppPythonTerms(url, template, self.body, continued, self.transcript,
                                       servers.asker(upstream))  # fmt: skip
        return None

    def _chat_leg(self, upstream: Upstream, chat: dict[str, Any]) -> Leg:
        info = self._servers.get(upstream) if self._servers else None
        if self._keeps_pieces(upstream):
            chat = asking_for_ids(chat)
        echo = info.echoes_prefill if info else None
        if chat.get("continue_final_message"):
            echo = False  # a placed message (handoff/placing.py) is not sent back first
        rewriter = self.dialect.rewriter(self.transcript, chat, echo)
        return self.dialect.leg_path(self.path, chat), chat, rewriter

    def _keeps_pieces(self, upstream: Upstream) -> bool:
        """Whether a chat leg on `upstream` asks for its tokens' pieces as the first leg
        did (both llama-servers: the same fields, taken out again the same way), so that
        what the model wrote stays known byte for byte after the cut."""
        servers, legs = self._servers, self.transcript.legs
        if servers is None or not self.asks_ids or self.dialect.name != "chat" or not legs:
            return False  # (no leg yet: the first server failed before its answer began)
        first = Upstream(legs[0].server)
        engines = (servers.get(first).engine, servers.get(upstream).engine)
        on_llama = all(engine in RENDERS_ON_ASKING for engine in engines)
        return on_llama and may_ask_for_ids(self.body)

    def _text_continuation(self, upstream: Upstream) -> dict[str, Any]:
        """The continuation from the answer's text, asked the way `upstream` continues a
        partial message (formats/continuers.py; chat only: see Fleet.continues)."""
        body = self.dialect.continuation(self.body, self.transcript)
        info = self._servers.get(upstream) if self._servers else None
        way = CONTINUERS.get(info.continues_by or "") if info else None
        continued = self.transcript.content or self.transcript.reasoning
        if way is not None and continued and self.dialect.name == "chat" and "messages" in body:
            body = way.ask(body)
        return body

    def _exact_ids(self, upstream: Upstream) -> list[int] | None:
        """The delivered token ids, when a continuation on `upstream` can go on from them:
        they are known and `upstream` reads them as the servers that made them meant them
        (one vocabulary, the transcript's), and the request holds no media (handoff/media.py)."""
        servers = self._servers
        said = self.transcript.content or self.transcript.reasoning
        if not self.asks_ids or servers is None or not said or media.held(self.body):
            return None
        if (self.transcript.reasoning or self.body.get("tools")) and not parses(
            servers.get(upstream)
        ):
            return None  # a native completion would not split reasoning or tool calls out
        vocabulary = self.transcript.vocabulary
        if vocabulary is None or servers.get(upstream).tokenizer != vocabulary:
            return None
        if upstream in servers.unverified:
            return None  # what it runs now could not be asked: its ids are not trusted
        return self.transcript.exact_ids()

    async def _exact_start(self, upstream: Upstream) -> tuple[str, list[int]] | None:
        """The prompt as `upstream` (a llama-server) renders it and the delivered token
        ids, when a continuation there can go on from the ids (see `_exact_ids`)."""
        if (ids := self._exact_ids(upstream)) is None:
            return None
        if (prompt := await self._chat_prompt(upstream)) is None:
            return None
        return prompt, ids

    async def tokens_held(self, source: Upstream, target: Upstream) -> int | None:
        """How many tokens the cut `source`'s cache holds for this answer (its rendering
        of the prompt and the delivered tokens), when the continuation on `target` goes
        on from the exact token ids; None otherwise."""
        if self._servers is None or (start := await self._exact_start(target)) is None:
            return None
        _, ids = start
        if (prompt := await self._chat_prompt(source)) is None:
            return None
        count = await self._servers.count_tokens(source, prompt)
        return None if count is None else count + len(ids)

    async def _chat_prompt(self, upstream: Upstream) -> str | None:
        """The chat prompt as `upstream` renders it (None where it cannot say)."""
        try:
            return await self._chat_prompt_or_why(upstream)
        except NotRendered:
            return None

    async def _chat_prompt_or_why(self, upstream: Upstream) -> str:
        """The chat prompt as the model would read it on `upstream` (handoff/renderings.py).
        Raises NotRendered."""
        assert self.renderings is not None
        return await self.renderings.of(upstream)

    def fits_without_asking(self, upstream: Upstream) -> bool:
        """Whether the rest of the answer surely fits on `upstream`, known without a
        request (its slot size is unknown, or a bound from the text's size proves it)."""
        if self._servers is None or not self.dialect.sizes_rooms:
            return True
        context = self._servers.get(upstream).slot_context
        if context is None:
            return True
        bound = self.dialect.upper_bound(self._text_continuation(upstream))
        return bound is not None and bound <= context

    def read_of(self, upstream: Upstream, body: dict[str, Any], answer: Any) -> None:
        """Keep what a server said it read of a continuation's prompt (llama-server's
        `tokens_evaluated`, of a shadow's prefill): the count of its text, which the
        room check at a handoff then need not ask (the count includes a BOS the server
        adds, which /tokenize leaves out: one token more room asked, never less). The
        server is sent that prompt again and again: its own ids of the rendering are
        asked, to go in the text's place (handoff/renderings.py)."""
        prompt = body.get("prompt")
        evaluated = answer.get("tokens_evaluated") if isinstance(answer, dict) else None
        if not isinstance(evaluated, int) or self._servers is None:
            return
        text, *ids = prompt if isinstance(prompt, list) else [prompt]
        if isinstance(text, str) and all(isinstance(i, int) for i in ids):
            self._servers.keep_count(self._counted, upstream, text, evaluated - len(ids))
            if ids and self.renderings is not None:  # (its text alone: a text continuation)
                self.renderings.ask_ids(upstream)

    async def fits(self, upstream: Upstream) -> bool:
        """Whether the rest of the answer, as it stands, fits on `upstream` (checked before
        an asked-for handoff leaves a server that is still working, while nothing has gone
        out: once something has, `asked_refusal` checks the room its continuation takes)."""
        return await self._no_room(upstream, self._text_continuation(upstream)) is None

    async def _no_room(self, upstream: Upstream, body: dict[str, Any]) -> str | None:
        """Why `upstream` cannot take this continuation whole, or None if it can (or
        cannot tell: then it is tried, and a refusal moves on down the ladder)."""
        if self._servers is None or not self.dialect.sizes_rooms:
            return None
        context = self._servers.get(upstream).slot_context
        if context is None:
            return None
        bound = self.dialect.upper_bound(body)
        needed = await self._servers.room_needed(upstream, body, context, bound, self._counted)
        if needed is None or needed <= context:
            return None
        return (
            f"{upstream.url} has {context} tokens per slot, the rest of this answer needs {needed}"
        )
