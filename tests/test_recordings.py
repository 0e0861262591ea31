"""Every recording in recordings/ replays through the current addon as the same stream,
with no llama-server; and a replay notices when something differs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mitmproxy import io

from scripts.testbed.mitm import ADDON
from scripts.testbed.replay import read_flows, replay_file

RECORDINGS = sorted((Path(__file__).resolve().parent.parent / "recordings").glob("*.mitm"))


@pytest.mark.parametrize("path", RECORDINGS, ids=[p.stem for p in RECORDINGS])
def test_a_recording_replays_as_the_same_stream(path: Path, tmp_path: Path) -> None:
    outcomes = replay_file(path, tmp_path)
    assert outcomes, f"{path.name} holds no answer"
    for outcome in outcomes:
        assert outcome.same, outcome.differences


def answers(path: Path) -> list:
    return [f for f in read_flows(path) if "spillover" in f.metadata]


def test_the_recordings_cover_every_kind_of_handoff() -> None:
    seen: dict[str, set[str]] = {}
    for path in RECORDINGS:
        for answer in answers(path):
            meta = answer.metadata["spillover"]
            kinds = {h["kind"] for h in meta["handoffs"]} or {"none"}
            body = answer.response.content or b""
            if len(meta["handoffs"]) > 1:
                kinds.add("chain")
            if b'"reasoning_content"' in body and meta["handoffs"]:
                kinds.add("reasoning")
            if b'"tool_calls"' in body and meta["handoffs"]:
                kinds.add("tool call")
            if any(h["at_token"] == 0 for h in meta["handoffs"]):
                kinds.add("before the first token")
            if any("in-band error" in h["reason"] for h in meta["handoffs"]):
                kinds.add("in-band error")
            if any("closed" in h["reason"] for h in meta["handoffs"]):
                kinds.add("died mid-answer")
            if answer.response.headers.get("x-spillover-handoff"):
                kinds.add("whole answer")
            if meta["handoffs"]:
                kinds.add(f"api {answer.request.path}")
            for kind in kinds:
                seen.setdefault(kind, set()).add(path.stem)
    wanted = {
        "none", "requested", "pressure", "failure", "chain", "reasoning", "tool call",
        "before the first token", "in-band error", "died mid-answer", "whole answer",
        "api /v1/chat/completions", "api /v1/messages", "api /v1/responses", "api /api/chat",
        "api /api/generate",
    }  # fmt: skip
    assert wanted <= set(seen), sorted(wanted - set(seen))


def rewrite(source: Path, target: Path, change) -> None:
    flows = read_flows(source)
    for flow in flows:
        change(flow)
    with target.open("wb") as f:
        writer = io.FlowWriter(f)
        for flow in flows:
            writer.add(flow)


def test_a_replay_notices_a_different_stream(tmp_path: Path) -> None:
    def one_token_changed(flow) -> None:
        if "spillover" in flow.metadata:
            body = flow.response.content
            index = body.index(b'"content":"', body.index(b"spillover: handoff"))
            flow.response.content = body[: index + 11] + b"X" + body[index + 11 :]

    changed = tmp_path / "changed.mitm"
    rewrite(Path(RECORDINGS[0]).with_name("requested.mitm"), changed, one_token_changed)
    (outcome,) = replay_file(changed, tmp_path)
    assert not outcome.same
    assert any("recorded" in d and "'content': 'X" in d for d in outcome.differences)


def test_a_replay_notices_a_leg_asked_differently(tmp_path: Path) -> None:
    def limit_changed(flow) -> None:
        meta = flow.metadata.get("spillover_exchange") or {}
        if meta.get("purpose") == "leg" and meta.get("leg") == 1:
            body = json.loads(flow.request.content)
            body["n_predict"] += 1
            flow.request.content = json.dumps(body).encode()

    changed = tmp_path / "changed.mitm"
    rewrite(Path(RECORDINGS[0]).with_name("requested.mitm"), changed, limit_changed)
    (outcome,) = replay_file(changed, tmp_path)
    assert outcome.differences == ["leg 1 request differs in n_predict"]


def test_reading_a_recording_with_the_addon_loaded_leaves_it_as_it_was(tmp_path: Path) -> None:
    """`mitmweb -s addon/spillover.py -r FILE` runs every flow read through the addon's
    hooks: recorded answers, legs and control requests must not be carried again."""
    mitmdump = Path(sys.executable).parent / "mitmdump"
    # All of them in one run (a flow file is its flows one after another): starting
    # mitmdump once per recording took most of this test's time.
    every, out = tmp_path / "every.mitm", tmp_path / "out.mitm"
    every.write_bytes(b"".join(path.read_bytes() for path in RECORDINGS))
    subprocess.run(
        [str(mitmdump), "-n", "-q", "-r", str(every), "-s", str(ADDON), "-w", str(out),
         "--set", "spillover_watch=false"],
        check=True, timeout=120,
    )  # fmt: skip
    before, after = [f for p in RECORDINGS for f in read_flows(p)], read_flows(out)
    assert len(before) > len(RECORDINGS)
    assert [f.id for f in after] == [f.id for f in before]
    for old, new in zip(before, after, strict=True):
        assert (old.response and old.response.content) == (new.response and new.response.content)
        assert old.metadata == new.metadata and old.comment == new.comment
