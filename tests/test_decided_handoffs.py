"""A handoff asked of a healthy answer (memory pressure, POST /spillover/handoff) is
decided before its leg is cut (addon/answer/decide.py): where no fallback may go on with
the answer, it stays whole on the primary, and the log and the status say why. A failure
with nowhere to go still ends in-band with the reason. Real llama-servers behind a real
proxy; the card is the sysfs stand-in the memory tests use. The last test, of how often a
declined slowdown is decided and told, asks no server: the splice alone."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from addon.answer import decide
from addon.answer.fleet import Fleet, Route
from addon.answer.splice import Splice
from addon.formats.carried import CHAT
from addon.servers.upstream import Upstream
from scripts.parts.summary import declined_lines
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.memfiles import FakeCard
from scripts.testbed.mitm import Mitmdump, watch_sysfs
from scripts.testbed.tinyvision import ensure_projector
from tests.streams import assert_one_clean_stream, chat_body, read_stream
from tests.test_media import asked
from tests.test_splice import handoff
from tests.throttle import Throttled

LONG = 300
CUT = 20
BY_ID = {"logit_bias": {"400": -5}}  # a token of the primary's vocabulary, by its id
NOT_ITS_IDS = "logit_bias name token ids"


def whole(server: LlamaServer, body: dict[str, Any]) -> str:
    """The answer `server` gives `body` asked directly."""
    reply = httpx.post(
        f"{server.url}/v1/chat/completions", json={**body, "stream": False}, timeout=60
    )
    return reply.json()["choices"][0]["message"]["content"]


def declined(proxy: Mitmdump, timeout: float = 10) -> dict[str, Any]:
    """The proxy's declined handoffs, once there is one."""
    deadline = time.monotonic() + timeout
    while True:
        said = httpx.get(f"{proxy.url}/spillover/status").json()["declined_handoffs"]
        if said["recent"]:
            return said
        assert time.monotonic() < deadline, "no handoff was declined"
        time.sleep(0.02)


def test_pressure_no_fallback_may_take_leaves_the_answer_whole_on_the_primary(
    start_server: Callable[..., LlamaServer], start_proxy: Callable[..., Mitmdump], tmp_path: Path
) -> None:
    """A `logit_bias` by token id and a fallback of another vocabulary: a step on the
    primary's card does not cut the answer (the fallback would read those ids as other
    tokens); it comes whole from the primary, with no error, and says why. The primary
    is held while the step is seen, so the answer cannot end before it."""
    primary, other = start_server("primary"), start_server("turns-fallback")
    sysfs = tmp_path / "sys"
    card0 = FakeCard(sysfs, "card0", total_mib=16384, used_mib=10000)
    FakeCard(sysfs, "card1", total_mib=8192, used_mib=2000)
    on = watch_sysfs(sysfs, {primary.url: "drm:card0", other.url: "drm:card1"})
    proxy = start_proxy(primary.url, [other.url], options=on)
    proxy.servers_known()
    body = chat_body(LONG, **BY_ID)
    seen: list[dict[str, Any]] = []
    with Throttled(primary.pid) as slowed:

        def step(n: int) -> None:
            if n == CUT:
                with slowed.held():
                    card0.set_used(15041)
                    seen.append(declined(proxy))

        stream = read_stream(proxy.url, body, on_chunk=step)
    assert_one_clean_stream(stream)
    assert stream.notes == [] and stream.text == whole(primary, body)
    (said,) = seen
    assert said["counts"] == {"pressure": 1}
    (entry,) = said["recent"]
    assert (entry["kind"], entry["server"]) == ("pressure", primary.url)
    why = entry["why"]
    assert why.startswith("no fallback may continue: ") and NOT_ITS_IDS in why, why
    assert other.url in why, why
    logged = proxy.log_path.read_text()
    assert f"a pressure handoff off {primary.url} was declined, the answer stays: {why}" in logged
    (line, last) = declined_lines(said)
    assert line == "handoffs declined: 1 (pressure 1)" and last.endswith(why), last


def test_a_failure_no_fallback_may_take_still_ends_in_band(
    start_server: Callable[..., LlamaServer], start_proxy: Callable[..., Mitmdump]
) -> None:
    """The same request, the primary killed mid-answer: nothing can go on with it, and
    the answer ends in-band with the reason, what was sent kept."""
    primary, other = start_server("primary"), start_server("turns-fallback")
    proxy = start_proxy(primary.url, [other.url])
    proxy.servers_known()
    stream = read_stream(
        proxy.url, chat_body(LONG, **BY_ID), on_chunk=lambda n: n == 8 and primary.kill()
    )
    (error,) = stream.errors
    message = error["error"]["message"]
    assert message.startswith("no server could continue this answer"), message
    assert NOT_ITS_IDS in message and other.url in message, message
    assert stream.segments[0] and stream.done == 0


def test_an_asked_handoff_no_fallback_may_take_leaves_the_answer_whole(
    models: dict[str, Path],
    start_server: Callable[..., LlamaServer],
    start_proxy: Callable[..., Mitmdump],
) -> None:
    """A picture in the request, a fallback of the same model without a projector: what
    decides it is the fallback's own answer (its rendering refuses the picture), asked
    while the primary keeps the answer. POST /spillover/handoff moves nothing, and the
    answer comes whole from the primary."""
    projector = ensure_projector(models["primary"].parent)
    primary = start_server("primary", extra_args=["--mmproj", str(projector)])
    blind = start_server("primary")
    proxy = start_proxy(primary.url, [blind.url])
    proxy.servers_known()
    body = {**asked(LONG), "cache_prompt": False}
    moved: list[int] = []
    with Throttled(primary.pid) as slowed:

        def ask(n: int) -> None:
            if n == CUT:
                with slowed.held():
                    moved.append(handoff(proxy, reason="test pressure"))

        stream = read_stream(proxy.url, body, on_chunk=ask)
    assert moved == [0]
    assert_one_clean_stream(stream)
    assert stream.notes == [] and stream.text == whole(primary, body)
    said = httpx.get(f"{proxy.url}/spillover/status").json()["declined_handoffs"]
    assert said["counts"] == {"requested": 1}
    (entry,) = said["recent"]
    why = entry["why"]
    assert "image input is not supported" in why and blind.url in why, why


def test_a_slowdown_declined_is_told_once_and_decided_again_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A slowdown asks for a handoff at every look while it lasts: with nowhere to go it
    is declined, told once, and not decided again for a while; decided again later for
    the same reason, it is not told again. (No server is asked anything: the answer's
    one server has nothing below it, and its leg is a stand-in that never ends.)"""
    alone = Upstream("http://127.0.0.1:1")
    fleet = Fleet()
    body = {"messages": [{"role": "user", "content": "Hi."}], "stream": True, "max_tokens": 50}

    async def scenario() -> list[asyncio.Future[bool] | None]:
        splice = Splice(
            path="/v1/chat/completions", dialect=CHAT, headers=[], body=body,
            raw_body=json.dumps(body).encode(), route=Route([alone], alone), fleet=fleet,
        )  # fmt: skip
        leg = splice._leg_task = asyncio.ensure_future(asyncio.sleep(5))
        asked = [splice.handoff("slow", "slow"), splice.handoff("slow", "slow")]
        monkeypatch.setattr(decide, "QUIET_S", 0.0)  # the next look decides it again
        asked += [splice.handoff("slow", "slow"), splice.handoff("asked", "requested")]
        leg.cancel()
        return asked

    assert asyncio.run(scenario()) == [None] * 4
    said = fleet.declines.status()
    assert said["counts"] == {"slow": 1, "requested": 1}
    assert [entry["why"] for entry in said["recent"]] == [
        f"no fallback may continue: {decide.NONE_BELOW}"
    ] * 2
