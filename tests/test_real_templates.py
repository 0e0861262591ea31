"""Every chat template llama.cpp ships (`models/templates` of the sdist the setup builds
llama-server from), served by a real llama-server (`--jinja --chat-template-file`), as the
next server of a cut answer, over the conversation shapes real clients send.

The truth is what the model saw and wrote: the server's own rendering of the ORIGINAL
request (`/apply-template`, generation prompt on, tools and kwargs included) followed by
the raw output. The continuation the addon builds (handoff/nextleg.py, the same code the
proxy runs) is what the server is then sent: a chat request, whose prompt is the server's
own rendering of it (`/apply-template` of the body sent), or a text completion, whose
prompt is the text sent. Each case must equal the truth or be refused with a reason:
0 wrong, 0 crashes. The counts are printed (and written in docs/engines.md).

The raw output differs from the delivered text in one way the primary's parser makes: a
leading space trimmed (the pieces' bytes keep it), as llama-server's parsers do.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from addon.answer.fleet import Fleet
from addon.formats.chat import Chat
from addon.formats.continuers import OWN_RENDERING, TRAILING_MESSAGE
from addon.handoff import placing, seen
from addon.handoff.nextleg import CannotContinue, NextLeg
from addon.servers.directory import ServerDirectory
from addon.servers.upstream import Upstream
from scripts.testbed.llamacppfiles import templates
from scripts.testbed.llamaserver import LlamaServer, ServerFailed
from tests.chat_shapes import DELIVERED, RAW, SHAPES, transcript


def verdicts(server: LlamaServer) -> list[tuple[str, bool, str, str]]:
    """(shape, exact, outcome, detail) of every case on `server`: the outcome is "exact
    by a trailing message", "exact by a text completion", "refused" or "wrong"."""
    return asyncio.run(_verdicts(server))


async def _verdicts(server: LlamaServer) -> list[tuple[str, bool, str, str]]:
    servers = ServerDirectory()
    upstream = Upstream(server.url)
    found = []
    try:
        await servers.probe(upstream, True)
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            for shape in SHAPES:
                for exact in (True, False):
                    outcome, detail = await _verdict(client, servers, upstream, shape, exact)
                    found.append((shape, exact, outcome, detail))
    finally:
        await servers.close()
    return found


async def _verdict(
    client: httpx.AsyncClient, servers: ServerDirectory, upstream: Upstream, shape: str,
    exact: bool,
) -> tuple[str, str]:  # fmt: skip
    body = {**SHAPES[shape], "max_tokens": 40, "stream": True, "temperature": 0}
    original = await client.post("/apply-template", json=body)
    wrote = seen.written(transcript(upstream.url, exact), "")
    assert wrote.text == (RAW if exact else DELIVERED)
    leg = NextLeg("/v1/chat/completions", Chat("messages"), body,
                  transcript(upstream.url, exact), servers, asks_ids=False)  # fmt: skip
    try:
        path, sent, _, _ = await leg.continuation(upstream)
    except CannotContinue as why:
        return "refused", str(why)
    if original.status_code != 200:
        return "wrong", f"continued though the server does not render the request: {sent}"
    truth = original.json()["prompt"] + wrote.text
    if path == "/completion":
        (prompt,) = sent["prompt"]
        way = "exact by a text completion"
    else:
        request = {k: v for k, v in sent.items() if k != "stream"}
        prompt = (await client.post("/apply-template", json=request)).json()["prompt"]
        way = "exact by a trailing message"
    if prompt != truth:
        return "wrong", seen.parting(prompt, truth) or ""
    return way, ""


@pytest.fixture(scope="module")
def served(models: dict[str, Path], server_logs: Path) -> Iterator[Any]:
    started: list[LlamaServer] = []

    def serve(template: Path) -> LlamaServer | None:
        args = ["--jinja", "--chat-template-file", str(template)]
        server = LlamaServer(models["fallback"], log_dir=server_logs, slots=1, extra_args=args)
        started.append(server)
        try:
            return server.start()
        except ServerFailed:
            return None  # this llama-server cannot load the template: it serves nothing

    yield serve
    for server in started:
        server.stop()


def test_every_real_template_continues_what_the_model_saw_or_refuses(served, capsys) -> None:
    found = templates()
    assert len(found) >= 60, "llama.cpp's templates"
    tally: Counter[str] = Counter()
    wrong: list[str] = []
    for template in found:
        server = served(template)
        if server is None:
            tally["template not loaded by llama-server"] += 1
            continue
        for shape, exact, outcome, detail in verdicts(server):
            tally[outcome] += 1
            if outcome == "wrong":
                wrong.append(f"{template.stem} / {shape} / exact={exact}: {detail}")
        server.stop()
    with capsys.disabled():
        print("\nreal templates:", json.dumps(dict(sorted(tally.items())), indent=1))
    assert not wrong, "\n".join(wrong)
    assert tally["exact by a trailing message"] and tally["exact by a text completion"]


BROKEN_BEFORE = [
    "microsoft-Phi-3.5-mini-instruct",
    "Qwen-Qwen3-0.6B",
    "mistralai-Mistral-Nemo-Instruct-2407",
]


def test_without_the_check_these_templates_continue_wrongly(served, monkeypatch) -> None:
    """The comparison is what keeps the cases above right: with it turned off (every
    trailing message taken as rendering the truth, where it lands taken as the truth's
    own place), templates the issue found corrupt continue from prompts the model never
    saw, and this harness says so."""

    async def placed_anyway(render, chat, truth, reasoning_open):
        return chat, ""

    monkeypatch.setattr(seen, "parting", lambda rendered, expected: None)
    monkeypatch.setattr(placing, "placed", placed_anyway)
    by_name = {template.stem: template for template in templates()}
    for name in BROKEN_BEFORE:
        server = served(by_name[name])
        assert server is not None
        assert "wrong" in [outcome for _, _, outcome, _ in verdicts(server)], name
        server.stop()


def test_the_start_up_proof_tells_the_two_ways_apart(served) -> None:
    """Llama 3.1's template renders a trailing message as the model saw it; Phi-3.5's
    renders the turn's opening otherwise. The status says which; chat answers go to
    either (on Phi-3.5 as the truth itself, a text completion), and Messages answers to
    either too, each compared there before it is sent (handoff/translated.py; on
    Phi-3.5 refused: tests/test_checked_apis.py shows it on Qwen3's)."""
    by_name = {template.stem: template for template in templates()}

    async def proven(server: LlamaServer) -> tuple[str | None, str, bool, bool]:
        fleet = Fleet()
        servers = fleet.servers
        try:
            info = await servers.probe(Upstream(server.url), True)
            upstream = Upstream(server.url)
            continues = fleet.continues(upstream, "chat"), fleet.continues(upstream, "messages")
            return info.continues_by, info.continues_why, *continues
        finally:
            await servers.close()

    llama = asyncio.run(proven(served(by_name["meta-llama-Llama-3.1-8B-Instruct"])))
    assert llama[0] == TRAILING_MESSAGE.name and llama[2:] == (True, True), llama
    assert "renders what the model saw" in llama[1]
    phi = asyncio.run(proven(served(by_name["microsoft-Phi-3.5-mini-instruct"])))
    assert phi[0] == OWN_RENDERING.name and phi[2:] == (True, True), phi
    assert "where the model saw" in phi[1] or "is closed" in phi[1]
