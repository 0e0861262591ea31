"""Replay recorded sessions through the current addon, with no llama-server anywhere.

For each answer in a recording (a `-w` file the addon wrote), every upstream server is
played by a stand-in that answers from the recorded legs and questions
(`scripts/testbed/replayserver.py`); the current addon runs in a real mitmdump in front of them;
the client's request is sent again; each asked-for handoff is asked for again once the
answer has reached the recorded cut. The client's stream must come out as recorded
(ids, timestamps and pause times aside), and each leg request as recorded.

    .venv/bin/python -m scripts.testbed.replay recordings/*.mitm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from mitmproxy import http, io

from scripts.parts.processes import free_port
from scripts.testbed.mitm import Mitmdump
from scripts.testbed.replayserver import ReplayServer, request_difference

# Anywhere in an event: ids, times and durations the servers make up anew for each answer.
VOLATILE = (
    "id", "item_id", "created", "created_at", "system_fingerprint", "timings",
    "total_duration", "load_duration", "prompt_eval_duration", "eval_duration",
)  # fmt: skip
PAUSE = re.compile(r", (first byte after|seen within) [0-9.]+ ms")  # timings, not behaviour
# Handoffs asked for (replayed by asking again at the cut), and how a POST is described.
ASKED = {"requested", "pressure", "slow"}
REQUESTED = "requested by POST /spillover/handoff: "


@dataclass
class Outcome:
    recording: str
    answer: str
    differences: list[str] = field(default_factory=list)

    @property
    def same(self) -> bool:
        return not self.differences


def read_flows(path: Path) -> list[http.HTTPFlow]:
    with path.open("rb") as f:
        return [flow for flow in io.FlowReader(f).stream() if isinstance(flow, http.HTTPFlow)]


def leg_flows(path: Path, port: int) -> list[http.HTTPFlow]:
    """The legs a recording's answers sent to the server at `port`, in order."""
    return [
        flow for flow in read_flows(path)
        if flow.metadata.get("spillover_exchange", {}).get("purpose") == "leg"
        and flow.request.port == port
    ]  # fmt: skip


def legs_to(path: Path, port: int) -> list[dict[str, Any]]:
    """The bodies of the legs a recording's answers sent to the server at `port`."""
    return [json.loads(flow.request.content or b"") for flow in leg_flows(path, port)]


def replay_file(path: Path, log_dir: Path | None = None) -> list[Outcome]:
    flows = read_flows(path)
    answers = [f for f in flows if "spillover" in f.metadata and f.response is not None]
    return [asyncio.run(_replay_answer(path, answer, flows, log_dir)) for answer in answers]


async def _replay_answer(
    path: Path, answer: http.HTTPFlow, flows: list[http.HTTPFlow], log_dir: Path | None
) -> Outcome:
    outcome = Outcome(path.name, answer.id)
    meta = answer.metadata["spillover"]
    ladder: list[str] = meta["ladder"]
    legs = set(meta.get("legs", []))
    exchanges = [
        f
        for f in flows
        if "spillover_exchange" in f.metadata
        and f.metadata["spillover_exchange"].get("answer") in (None, answer.id)
        and (f.id in legs or f.metadata["spillover_exchange"]["purpose"] == "question")
    ]
    servers, urls = await _stand_ins(ladder, exchanges)
    options = [
        "spillover_watch=false",
        "spillover_health_s=0",  # the stand-ins serve what was recorded, and /health was not
        f"spillover_exact_replay={str(meta.get('exact_replay', True)).lower()}",
    ]
    proxy = Mitmdump(
        urls[ladder[0]], [urls[u] for u in ladder[1:]], options=options, log_dir=log_dir
    )
    await asyncio.to_thread(proxy.start)
    try:
        await asyncio.to_thread(proxy.servers_known)  # the stand-ins answer meanwhile
        response = await _replay_request(proxy, answer, meta, servers, outcome)
    finally:
        await asyncio.to_thread(proxy.stop)
        for server in servers.values():
            await server.stop()
    back = {new: old for old, new in urls.items()}
    for handoff in meta["handoffs"]:
        if handoff["kind"] in ASKED and handoff["kind"] != "requested":
            back[REQUESTED + handoff["reason"]] = handoff["reason"]
    _compare(answer, response, back, outcome)
    for server in servers.values():
        outcome.differences += filter(None, map(request_difference, server.exchanges))
    return outcome


async def _stand_ins(
    ladder: list[str], exchanges: list[http.HTTPFlow]
) -> tuple[dict[str, ReplayServer], dict[str, str]]:
    """A stand-in per recorded server, and where each recorded URL now lives. A server
    that refused every connection gets a port nothing listens on."""
    servers: dict[str, ReplayServer] = {}
    urls: dict[str, str] = {}
    for url in dict.fromkeys(
        [*ladder, *(f.metadata["spillover_exchange"]["server"] for f in exchanges)]
    ):
        mine = [f for f in exchanges if f.metadata["spillover_exchange"]["server"] == url]
        refused = all(f.response is None and _refused(f) for f in mine)
        if refused:
            urls[url] = f"http://127.0.0.1:{free_port()}"
            continue
        servers[url] = ReplayServer(mine)
        await servers[url].start()
        urls[url] = f"http://127.0.0.1:{servers[url].port}"
    return servers, urls


def _refused(flow: http.HTTPFlow) -> bool:
    """The connection itself was refused (the addon's own words, or httpx's)."""
    message = flow.error.msg if flow.error else ""
    return "cannot connect" in message or "ConnectError" in message


async def _replay_request(
    proxy: Mitmdump,
    answer: http.HTTPFlow,
    meta: dict,
    servers: dict[str, ReplayServer],
    outcome: Outcome,
) -> httpx.Response:
    request = answer.request
    headers = {
        k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")
    }
    async with httpx.AsyncClient(timeout=30) as client:
        send = client.post(f"{proxy.url}{request.path}", content=request.content, headers=headers)
        reply = asyncio.ensure_future(send)
        asked = [h for h in meta["handoffs"] if h["kind"] in ASKED]
        cut_legs = [
            r
            for s in servers.values()
            for r in s.exchanges
            if r.meta["purpose"] == "leg" and r.meta["outcome"] == "handed off"
        ]
        cut_legs.sort(key=lambda r: r.meta["leg"])
        for handoff, leg in zip(asked, cut_legs, strict=False):
            await _ask_at_the_cut(client, proxy, handoff, leg, outcome)
        response = await reply
    return response


async def _ask_at_the_cut(client, proxy, handoff: dict, leg, outcome: Outcome) -> None:
    """Once the cut leg's recorded bytes are out and the addon has passed on as many
    tokens as it had then, ask for the handoff as it was asked for then."""
    try:
        await asyncio.wait_for(leg.sent.wait(), 10)
    except TimeoutError:
        outcome.differences.append(f"leg {leg.meta['leg']} was never asked for")
        return
    deadline = time.monotonic() + 5
    tokens = None
    while time.monotonic() < deadline:
        live = (await client.get(f"{proxy.url}/spillover/status")).json()["live"]
        tokens = live[0]["tokens"] if live else None
        if tokens == handoff["at_token"]:
            break
        await asyncio.sleep(0.01)
    else:
        outcome.differences.append(
            f"the answer stood at {tokens} tokens, not {handoff['at_token']}, at the cut"
        )
    await client.post(f"{proxy.url}/spillover/handoff", json={"reason": asked_reason(handoff)})


def asked_reason(handoff: dict) -> str:
    """The reason to give POST /spillover/handoff so the note reads as recorded, as far as
    it can: a pressure or slowdown handoff is asked for by POST here, and says so."""
    reason = handoff["reason"]
    return reason.removeprefix(REQUESTED) if handoff["kind"] == "requested" else reason


def _normalized(data: bytes, back: dict[str, str]) -> list:
    """The events of a stream (or a whole JSON answer) without what may differ."""
    text = data.decode("utf-8", "replace")
    for new, old in back.items():
        text = text.replace(new, old).replace(
            f"'127.0.0.1', {new.rsplit(':', 1)[1]}", f"'127.0.0.1', {old.rsplit(':', 1)[1]}"
        )
    text = PAUSE.sub("", text)
    events: list = []
    for event in _events(text):
        lines = [line for line in event.split("\n") if line.startswith("data:")]
        payload = "\n".join(line[5:].strip() for line in lines) if lines else event
        try:
            parsed = json.loads(payload)
        except ValueError:
            events.append(event)
            continue
        events.append(_without_volatile(parsed))
    return events


def _events(text: str) -> list[str]:
    """A stream's events (SSE), lines (NDJSON) or its one whole JSON answer."""
    if "data:" in text:
        parts = text.split("\n\n")
    elif text.count("\n") > 1:
        parts = text.split("\n")
    else:
        parts = [text]
    return [part.strip() for part in parts if part.strip()]


def _without_volatile(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_volatile(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_without_volatile(v) for v in value]
    return value


def _compare(
    answer: http.HTTPFlow, response: httpx.Response, back: dict[str, str], outcome: Outcome
) -> None:
    assert answer.response is not None
    if answer.response.status_code != response.status_code:
        outcome.differences.append(
            f"status {answer.response.status_code} recorded, {response.status_code} replayed"
        )
    notes = [
        _normalized(r.headers.get("x-spillover-handoff", "").encode(), urls)
        for r, urls in ((answer.response, {}), (response, back))
    ]
    if notes[0] != notes[1]:
        outcome.differences.append(f"x-spillover-handoff: recorded {notes[0]}, replayed {notes[1]}")
    recorded = _normalized(answer.response.content or b"", {})
    replayed = _normalized(response.content, back)
    for index, (old, new) in enumerate(zip(recorded, replayed, strict=False)):
        if old != new:
            outcome.differences.append(f"event {index}: recorded {old!r}, replayed {new!r}")
            return
    if len(recorded) != len(replayed):
        outcome.differences.append(f"{len(recorded)} events recorded, {len(replayed)} replayed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recordings", nargs="+", type=Path)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="spillover-replay-"))
    failed = 0
    for path in args.recordings:
        for outcome in replay_file(path, logs):
            verdict = "same stream" if outcome.same else "DIFFERENT"
            print(f"{outcome.recording}: {verdict}")
            for difference in outcome.differences:
                print(f"    {difference}")
            failed += not outcome.same
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
