"""What a handoff to a shadowed server no longer asks in its pause, with real llama-servers.

A shadow's prefill of the continuation tells how many tokens the server read of it
(`tokens_evaluated`); the room check at the handoff takes the prompt's count from there
instead of asking the server to tokenize the whole prompt again (NextLeg.read_of). The
count must be the server's own: the room a prompt takes is what the server reads of it,
its BOS included where it adds one (which /tokenize leaves out). And while a handoff is
being decided, the shadow starts no update (one started then is still in flight at the
cut, and the continuation waits for all of it), and once the answer stays where it is,
its shadow goes on."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from addon.formats.chat import Chat
from addon.formats.transcript import Transcript
from addon.handoff.nextleg import NextLeg
from addon.handoff.shadow import POLL_S, Shadow, ShadowBudget, prompt_only
from addon.servers.directory import ServerDirectory
from addon.servers.prompts import Counted
from addon.servers.upstream import Upstream
from tests.chat_shapes import QUESTION

IDS = [5, 6, 7, 8, 9]  # the answer so far, as token ids after the prompt's text
LIMIT = 40


async def counts(url: str) -> dict[str, int]:
    """What the server reads of a continuation's prompt (its text and IDS), by three
    ways: a prefill's `tokens_evaluated`, the room the check takes from it, and the room
    the check asks /tokenize for (as it did before any prefill)."""
    servers = ServerDirectory()
    upstream = Upstream(url)
    try:
        await servers.probe(upstream, True)
        leg = NextLeg("/v1/chat/completions", Chat("messages"), {"messages": [QUESTION]},
                      Transcript(), servers, False)  # fmt: skip
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            rendered = await client.post("/apply-template", json={"messages": [QUESTION]})
        body = {"prompt": [rendered.json()["prompt"], *IDS], "n_predict": LIMIT}
        asked = await servers.room_needed(upstream, body, room=1, bound=None, counted=Counted())
        budget = ShadowBudget(lambda _: {})
        try:
            answer = await budget.prefill(url, "/completion", prompt_only("/completion", body))
        finally:
            await budget.close()
        leg.read_of(upstream, body, answer)
        from_prefill = await servers.room_needed(
            upstream, body, room=1, bound=None, counted=leg._counted
        )
    finally:
        await servers.close()
    return {"evaluated": answer["tokens_evaluated"], "from prefill": from_prefill, "asked": asked}


@pytest.mark.parametrize("model", ["fallback", "bos-fallback"])
def test_the_room_a_shadow_saw_is_what_the_server_reads(start_server, model: str) -> None:
    server = start_server(model)
    seen = asyncio.run(counts(server.url))
    # The room taken from the prefill is what the server read, and the limit after it.
    assert seen["from prefill"] == seen["evaluated"] + LIMIT
    bos = httpx.post(f"{server.url}/tokenize", json={"content": "", "add_special": True})
    adds = len(bos.json()["tokens"])
    assert adds == (1 if model == "bos-fallback" else 0)  # the case each model stands for
    # /tokenize leaves out the BOS the server adds: the count from the prefill is the
    # server's own, never less room.
    assert seen["from prefill"] == seen["asked"] + adds


async def updates_while(url: str) -> list[int]:
    """A shadow's updates on the server at `url`: after its first, after tokens enough
    for another came while a handoff of its answer was being decided, and after."""
    servers = ServerDirectory()
    upstream = Upstream(url)
    transcript = Transcript()
    transcript.begin_leg(url)
    budget = ShadowBudget(lambda _: {})
    budget.every = 2
    try:
        await servers.probe(upstream, True)
        body: dict[str, Any] = {"messages": [QUESTION], "max_tokens": 50, "stream": True}
        leg = NextLeg("/v1/chat/completions", Chat("messages"), body, transcript, servers, False)
        write(transcript, "The river")
        moving = False
        shadow = Shadow(leg, transcript, upstream, budget, lambda: moving)
        seen = [await updated(shadow, 1)]
        moving = True
        write(transcript, " runs north to the sea")
        await asyncio.sleep(30 * POLL_S)
        seen.append(shadow.updates)
        moving = False
        seen.append(await updated(shadow, seen[-1] + 1))
        shadow.stop("the test is over")
        return seen
    finally:
        await budget.close()
        await servers.close()


def write(transcript: Transcript, text: str) -> None:
    for word in text.split(" "):
        transcript.record({"choices": [{"index": 0, "delta": {"content": f"{word} "}}]})


async def updated(shadow: Shadow, count: int) -> int:
    for _ in range(1000):
        if shadow.updates >= count:
            return shadow.updates
        await asyncio.sleep(POLL_S)
    raise AssertionError(f"{shadow.updates} updates, not {count}: {shadow.status()}")


def test_no_shadow_update_starts_while_its_answer_is_moving(start_server) -> None:
    first, moving, after = asyncio.run(updates_while(start_server("fallback").url))
    assert first >= 1
    assert moving == first  # tokens came, and no update went out while it was moving
    assert after > moving


def test_an_answer_keeps_only_its_latest_counts() -> None:
    """A text continuation's text grows with the answer: each room check may count a new
    one, and a long answer's checks must not keep them all."""
    counted = Counted()
    for length in range(1, 11):
        counted.put(("http://fallback", None, "x" * length), length)
    kept = [
        length for length in range(1, 11) if counted.get(("http://fallback", None, "x" * length))
    ]
    assert kept == list(range(11 - Counted.KEPT, 11))
