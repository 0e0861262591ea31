"""What the addon knows about each upstream server (info.py), asked through a shared
client when it is first needed, and again whenever the server may have changed
(identity.py): when it answers again after being down, and right before a continuation
is sent there.

- Which engine it is and the models it serves (`engines.py`).
- Whether it continues a partial assistant message, proven (`proof.py`): a server that
  does not, or cannot be checked, is never asked to continue an answer that sent text.
- Whether it echoes an assistant prefill at the start of its answer (some llama-server
  builds do): knowing keeps the splice from dropping real text that merely looks like it.
- Its context per slot (`/props`), so a continuation goes only to a server it fits on.
- Its tokenizer's fingerprint and its model's name, so token ids go only to a server
  that reads them the same way (token-exact replay, `handoff/exact.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from addon.formats.continuers import CONTINUERS, TRAILING_MESSAGE
from addon.formats.template import ChatTemplate, NoTemplate, read_template
from addon.servers import engines, proof
from addon.servers.credentials import Credentials
from addon.servers.declared import declare
from addon.servers.engines import RENDERS_ON_ASKING, ROUTER
from addon.servers.exchange import Exchange, RecordingTransport
from addon.servers.fingerprint import Fingerprint, fingerprint_for_migration
from addon.servers.identity import dated_template, identity_of
from addon.servers.info import ServerInfo, slot_context, unanswered
from addon.servers.prompts import PromptQuestions
from addon.servers.traits import (
    echoes_prefill,
    fingerprint_of,
    tokenizer_fingerprint,
    tokenizer_probe,
)
from addon.servers.upstream import Upstream
from addon.servers.vllm_routes import own_routes

log = logging.getLogger(__name__)


QUESTION_POOL = 4  # connections kept per server
REASK_SECONDS = 5.0


def _changed(old: dict[str, str], new: dict[str, str]) -> set[str]:
    return {url for url in {*old, *new} if old.get(url) != new.get(url)}


class ServerDirectory(PromptQuestions):
    def __init__(self, on_exchange: Callable[[Exchange], None] = lambda _: None) -> None:
        self._on_exchange = on_exchange
        self.credentials = Credentials()
        self.info: dict[Upstream, ServerInfo] = {}
        self._client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Future[Any]] = set()
        self._asked: dict[Upstream, float] = {}
        self._probing: dict[Upstream, asyncio.Future[Any]] = {}  # being learnt now
        self._reasks: set[asyncio.TimerHandle] = set()
        self._named: dict[str, str] = {}  # server -> the model it is asked in
        self._template_files: dict[str, str] = {}  # server -> its model's template file
        self._declared: dict[str, str] = {}  # server -> how its operator says it continues
        self.templates: dict[Upstream, ChatTemplate] = {}
        # Servers whose last check before a continuation could not be answered.
        self.unverified: set[Upstream] = set()
        # Where every server saves its slots (spillover_slot_dir): set, each server is
        # fingerprinted too (one probe completion, not cached), for KV migration.
        self.slot_dir: Path | None = None

    def name_models(self, named: dict[str, str], running: bool) -> None:
        """Ask these servers in these models (spillover_models)."""
        self._forget(_changed(self._named, named), running)
        self._named = dict(named)

    def name_templates(self, files: dict[str, str], running: bool) -> None:
        """Render these servers' chat prompts from these files (spillover_templates: a
        GGUF or a tokenizer_config.json), for a text completion continuation."""
        self._forget(_changed(self._template_files, files), running)
        self._template_files = dict(files)

    def declare_ways(self, ways: dict[str, str], running: bool) -> None:
        """These servers continue the way their operator says (spillover_continue_by:
        servers/declared.py), whatever the check finds."""
        self._forget(_changed(self._declared, ways), running)
        self._declared = dict(ways)

    def _forget(self, servers: set[str], running: bool) -> None:
        """What was learned of these servers is asked again (once running, now)."""
        for upstream in [u for u in self.info if u.url in servers]:
            del self.info[upstream]
            self._asked.pop(upstream, None)
        if running:
            self.learn([Upstream(url) for url in servers], fallbacks=True)

    def back(self, url: str) -> None:
        """`url` answers again after being down: it may be another process, with another
        model; what it says it runs is asked again, and all of it where that changed (a
        server known only by its behaviour is judged by it again)."""
        upstream = next((u for u in self.info if u.url == url), None)
        if upstream is None:
            return
        if self.get(upstream).proof in ("behaviour", "declared"):
            # Nothing it answers says what it runs: how it behaves is asked again.
            self._in_background(self._probe_again(upstream))
        else:
            self._in_background(self.recheck(upstream, generate=False))

    async def _probe_again(self, upstream: Upstream, generate: bool = True) -> None:
        """`probe` again, unless it is being probed now."""
        if upstream in self._probing:
            return
        probe = self._probing[upstream] = asyncio.ensure_future(self.probe(upstream, generate))
        try:
            await probe
        finally:
            self._probing.pop(upstream, None)

    async def recheck(self, upstream: Upstream, generate: bool, learn: bool = True) -> str | None:
        """Whether `upstream` still runs what it was proven on (what it says of its model
        and build, its tokenizer's ids of a probe text), asked now; where not, all of it
        is learnt again before this returns (`learn_again`, unless `learn` is False), and
        what changed is returned. One that cannot be asked now is left as it was known
        (a leg sent there fails, and says why)."""
        info = self.info.get(upstream)
        if info is None or not info.asked or upstream in self._probing:
            return None
        try:
            # All at once: this runs in a handoff's pause (the probe's ids count only
            # where the server says it runs what it ran).
            questions = [self._ask(upstream, "/props"), self._ask(upstream, "/v1/models")]
            if info.tokenizer is not None:
                questions.append(self._ask(upstream, *tokenizer_probe(info)))
            props, models, *probe = await asyncio.gather(*questions, return_exceptions=True)
            if isinstance(props, (httpx.HTTPStatusError, ValueError)):
                props = None  # as when it was learnt: an engine without /props
            # (Unanswered, it is not one without: a timeout raises below, and the server
            # stays as it was known. Taken as changed, it was learnt again at once, and
            # the pause waited on the same unanswered question twice.)
            for answer in (props, models):
                if isinstance(answer, BaseException):
                    raise answer
            changed = []
            if identity_of(props, models) != info.identity:
                changed.append("what it says it runs")
            elif probe:
                if isinstance(ids := probe[0], BaseException):
                    raise ids
                if fingerprint_of(info, models, ids["tokens"]) != info.tokenizer:
                    changed.append("its tokenizer")
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            self.unverified.add(upstream)  # its tokenizer is not known now: text, not ids
            return None
        self.unverified.discard(upstream)
        if not changed:
            return None
        why = f"{' and '.join(changed)} changed since it was proven"
        if learn:
            await self.learn_again(upstream, generate, why)
        return why

    async def learn_again(self, upstream: Upstream, generate: bool, why: str) -> None:
        """All of `upstream` learnt again, `why` (what changed) logged (`generate`: it may
        be asked to write a token, as a fallback is)."""
        log.warning("%s: %s: learning it again", upstream.url, why)
        await self._probe_again(upstream, generate)

    def get(self, upstream: Upstream) -> ServerInfo:
        return self.info.get(upstream) or ServerInfo()

    def wanting_keys(self) -> frozenset[str]:
        """The servers that turned a question away for want of a key."""
        return frozenset(server.url for server, info in self.info.items() if info.wants_key)

    def learn(self, upstreams: list[Upstream], fallbacks: bool = False) -> None:
        """Ask each server not yet known, in the background (one that could not answer
        is asked again, at most every few seconds). Only fallbacks are asked to generate
        (the prefill probe): a primary is asked nothing that changes its state."""
        now = time.monotonic()
        for upstream in upstreams:
            known = self.info.get(upstream)
            fingerprinted = self.slot_dir is None or (known and known.fingerprint is not None)
            if known is not None and known.settled and fingerprinted:
                continue
            if upstream in self._probing:
                continue
            if upstream in self._asked and now - self._asked[upstream] < REASK_SECONDS:
                continue
            self._asked[upstream] = now
            task = self._probing[upstream] = self._in_background(self.probe(upstream, fallbacks))
            task.add_done_callback(lambda _, server=upstream: self._probing.pop(server, None))

    async def learnt(self, upstreams: Iterable[Upstream], within: float) -> bool:
        """Wait, `within` seconds at most, until what is being learnt of these servers now
        is known; False where nothing was (an answer cut before its fallback is proven
        waits for the proof under way, rather than end for want of it)."""
        under_way = [self._probing[u] for u in upstreams if u in self._probing]
        if under_way:
            await asyncio.wait(under_way, timeout=within)  # the probes run on if it ends
        return bool(under_way)

    def _in_background(self, work: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
        """Run `work` on its own, cancelled by `close`."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        for reask in self._reasks:
            reask.cancel()
        for task in self._tasks:
            task.cancel()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def client(self) -> httpx.AsyncClient:
        # One client for all, on the legs' own connections (servers/kept.py): a few kept
        # per server, as a handoff's questions come in a burst.
        if self._client is None:
            transport = RecordingTransport(self._on_exchange, QUESTION_POOL)
            self._client = httpx.AsyncClient(timeout=5, transport=transport)
        return self._client

    async def _ask(self, upstream: Upstream, path: str, body: Any = None) -> Any:
        """A question's JSON answer, asked with the server's own key; raises httpx.HTTPError
        (a refusal such as 401 included) or ValueError."""
        headers = self.credentials.question_headers(upstream.url)
        url = f"{upstream.url}{path}"
        if body is None:
            response = await self.client.get(url, headers=headers)
        else:
            response = await self.client.post(url, json=body, headers=headers)
        return response.raise_for_status().json()

    async def probe(self, upstream: Upstream, generate: bool) -> ServerInfo:
        """Ask `upstream` about itself (`generate`: it may be asked to write a token, as
        a fallback is) and keep what it says; `learn` does this in the background."""
        info = ServerInfo()
        props = await self._answer(info, upstream, "/props")
        if props is not None:
            try:
                info.slot_context = slot_context(props)
            except (ValueError, KeyError, TypeError) as exc:
                unanswered(upstream, info, "/props", exc)
        models = await self._answer(info, upstream, "/v1/models")
        info.identity = identity_of(props, models)
        info.engine, info.models = engines.identify(props, models), engines.model_ids(models)
        templated = props
        if info.engine == "vllm":  # its template, where it serves it (/tokenizer_info)
            templated = await self._answer(info, upstream, "/tokenizer_info")
        info.dated_template = dated_template(templated)
        info.model = self._named.get(upstream.url) or (info.models[0] if info.models else None)
        if info.slot_context is None and (length := engines.context_length(models)):
            info.slot_context = length
            info.unanswered.pop("/props", None)  # what it would have said is known
        if info.engine == ROUTER:
            info.slot_context = await self._routed_context(info, upstream, generate)

        if props is None and models is None and not generate:
            info.continues_why = "not checked: it answered neither /props nor /v1/models"
        else:
            try:
                template = await self._template(upstream, info) if generate else None
                found = await proof.continues(
                    self.asker(upstream), info.engine, info.model, generate, template
                )
                info.continues, info.continues_why = found.continues, found.why
                info.continues_by = found.continuer.name if found.continuer else None
                info.trims_whitespace = found.trims
                info.echoes_prefill = found.echoes
                if found.continues:
                    info.proof = "behaviour" if found.by_behaviour else "engine"
                if found.template is not None:  # as its text route is to be given it
                    self.templates[upstream] = found.template
                info.settled = True  # it answered: not asked again
            except proof.ERRORS as exc:
                info.continues_why = f"not checked: {proof.failed(exc)}"
        if (way := self._declared.get(upstream.url)) is not None:
            declare(upstream.url, info, way)
        # Known from here on: a handoff soon after start-up may go there already. The
        # rest fills in as it is answered.
        self.info[upstream] = info
        try:
            info.tokenizer = await tokenizer_fingerprint(self.asker(upstream), info, models)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            unanswered(upstream, info, "/tokenize", exc)
        if info.engine == "vllm":
            try:
                info.own_routes = await own_routes(self.asker(upstream), info.model)
            except (httpx.HTTPError, ValueError) as exc:
                info.own_routes = f"not asked: {exc!r}"
        if generate and info.echoes_prefill is None:
            try:
                way = CONTINUERS.get(info.continues_by or "", TRAILING_MESSAGE)
                info.echoes_prefill = await echoes_prefill(
                    self.asker(upstream), self.own_model(upstream, None), way
                )
            except (httpx.HTTPError, ValueError) as exc:
                unanswered(upstream, info, "/v1/chat/completions", exc)
        if self.slot_dir is not None:
            info.fingerprint = await self._fingerprint(upstream, self.slot_dir)
        info.asked = True
        if (
            info.engine in RENDERS_ON_ASKING
            and info.continues_by == TRAILING_MESSAGE.name
            and info.proof == "engine"
        ):
            # Last: renderings take no slot, so they never share a batch with a handoff's
            # first continuation the way a question that generates would.
            try:
                info.continues_why += await proof.shapes_rendered_open(
                    self.asker(upstream), info.model if info.engine == ROUTER else None
                )
            except proof.ERRORS as exc:
                log.info("%s: the other chat shapes were not rendered: %r", upstream.url, exc)
        if generate and not info.settled:
            # A fallback that could not be asked is asked again without waiting for
            # traffic: until it answers, it continues no answer.
            loop = asyncio.get_running_loop()
            self._reasks = {h for h in self._reasks if h.when() > loop.time()}  # pending
            self._reasks.add(
                loop.call_later(REASK_SECONDS, lambda: self.learn([upstream], fallbacks=True))
            )
        return info

    async def _template(self, upstream: Upstream, info: ServerInfo) -> ChatTemplate | None:
        """Its model's chat template: from the file spillover_templates names, else from
        the GGUF a llama-cpp-python server names as its model (on this machine)."""
        named = self._template_files.get(upstream.url)
        path = named or (info.model if info.engine == "llama-cpp-python" else None)
        if path is None or (not named and not path.endswith(".gguf")):
            return None
        try:
            template = await asyncio.to_thread(read_template, Path(path))
        except NoTemplate as exc:
            info.template_from = f"none: {exc}"
            return None
        info.template_from = template.origin
        self.templates[upstream] = template
        return template

    async def _routed_context(
        self, info: ServerInfo, upstream: Upstream, may_load: bool
    ) -> int | None:
        """A router's context per slot is its model's (its own `/props` says 0). Asking
        loads the model, which only a fallback is asked to do."""
        if not may_load or info.model is None:
            return None
        try:
            return slot_context(await self._ask(upstream, f"/props?model={quote(info.model)}"))
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            unanswered(upstream, info, "/props", exc)
            return None

    async def _answer(self, info: ServerInfo, upstream: Upstream, path: str) -> Any:
        try:
            return await self._ask(upstream, path)
        except (httpx.HTTPError, ValueError) as exc:
            unanswered(upstream, info, path, exc)
            return None

    async def _fingerprint(self, upstream: Upstream, slot_dir: Path) -> Fingerprint | str:
        return await fingerprint_for_migration(self.asker(upstream), slot_dir)

    def asker(self, upstream: Upstream) -> Callable[[str, Any], Awaitable[Any]]:
        """`_ask` bound to one server, for the modules that ask it questions of their own."""
        return lambda path, body: self._ask(upstream, path, body)

    def own_model(self, upstream: Upstream, asked: Any) -> str | None:
        """The name `upstream` serves its model by (the one spillover_models names, else
        the first it lists), where the client asked for another (`asked`) and the server
        holds clients to its names (every engine but llama-server, which takes any name)."""
        info = self.get(upstream)
        if info.engine in (None, "llama-server") or info.model is None or asked in info.models:
            return None
        return info.model

    def same_tokenizer(self, a: Upstream, b: Upstream) -> bool:
        mine = self.get(a).tokenizer
        return mine is not None and mine == self.get(b).tokenizer
