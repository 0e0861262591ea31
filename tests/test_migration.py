"""KV migration between real llama-servers running the same model: the answer's state is
saved on the source and restored on the target, which then reads almost nothing; any
failure falls back to replay and leaves nothing behind; a model of the same shape with
other weights is refused (llama-server itself would restore it without complaint).

Both servers run with --ubatch-size 32, as in the exact-replay proof (test_exact_replay.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from addon.handoff.migration import Migrator
from addon.handoff.record import Moved
from addon.servers.fingerprint import Fingerprint
from addon.servers.upstream import Upstream
from scripts.testbed.mitm import REPO, Mitmdump
from scripts.testbed.tinymodels import PRESETS, Preset, write_model
from tests.streams import assert_one_clean_stream, chat_body, direct_text, read_stream
from tests.test_exact_replay import SAME_BATCHES, fragment_bias
from tests.test_shadow import long_body
from tests.test_splice import handoff_after

ANSWER = 64
CUTS = 100
# A prompt long enough that every cut leaves more than the migrator's minimum to move.
MESSAGES = [{"role": "user", "content": " ".join(["Tell me about the river and the bridge."] * 10)}]
STREAMS = 24
MOVED = re.compile(r"after (\d+) tokens .*replayed as token ids, moved (\d+) tokens' KV state")


def slot_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("spillover-*"))


def fingerprinted(proxy: Mitmdump, urls: list[str]) -> dict:
    servers = proxy.servers_known()
    for url in urls:
        assert servers[url]["tokenizer"] and servers[url]["fingerprint"], servers[url]
    return servers


@pytest.fixture
def slot_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "slots"
    directory.mkdir()
    return directory


def test_any_cut_migrates_and_gives_the_uninterrupted_answer(
    start_server, start_proxy, slot_dir: Path
) -> None:
    saves = ["--slot-save-path", str(slot_dir)]
    first = start_server("primary", extra_args=[*SAME_BATCHES, *saves])
    second = start_server("primary", extra_args=[*SAME_BATCHES, *saves])
    proxy = start_proxy(first.url, [second.url], options=[f"spillover_slot_dir={slot_dir}"])
    servers = fingerprinted(proxy, [first.url, second.url])
    assert isinstance(servers[first.url]["fingerprint"], dict)
    assert servers[first.url]["fingerprint"] == servers[second.url]["fingerprint"]

    bias = fragment_bias(first.url)
    body = chat_body(ANSWER, logit_bias=bias, messages=MESSAGES)
    whole = direct_text(first.url, ANSWER, logit_bias=bias, messages=MESSAGES)
    # An answer that is not cut tells the policy how fast the primary reads a prompt.
    assert read_stream(proxy.url, body).text == whole
    rates = httpx.get(f"{proxy.url}/spillover/status").json()["migration"]["rates"]
    assert rates["read_ms_per_token"][first.url] > 0, rates
    rng = random.Random(20261130)
    cuts = []
    for _ in range(2 * CUTS):
        on_chunk = handoff_after(proxy, rng.randint(1, ANSWER - 24), hold=first)
        stream = read_stream(proxy.url, body, on_chunk=on_chunk)
        assert_one_clean_stream(stream)
        if not stream.notes:
            continue  # the handoff came after the last token: nothing to cut
        (note,) = stream.notes
        moved = MOVED.search(note)
        assert moved, note
        assert stream.text == whole, note
        # The target read only what the restored state did not hold.
        (timings,) = [c["timings"] for c in stream.chunks if "timings" in c]
        assert timings["prompt_n"] <= 2, (note, timings)
        cuts.append(int(moved.group(1)))
        if len(cuts) == CUTS:
            break
    assert len(cuts) == CUTS and len(set(cuts)) >= 20, sorted(set(cuts))
    assert slot_files(slot_dir) == []
    status = httpx.get(f"{proxy.url}/spillover/status").json()
    assert not any(status["migration"]["reserved"].values()), status["migration"]


def test_a_model_of_the_same_shape_with_other_weights_is_refused(
    start_server, start_proxy, slot_dir: Path, tmp_path: Path
) -> None:
    same = PRESETS["primary"]
    other = tmp_path / "other-weights.gguf"
    write_model(other, Preset(same.n_layer, same.n_embd, same.n_head, same.n_ff, seed=99))
    saves = ["--slot-save-path", str(slot_dir)]
    first = start_server("primary", extra_args=saves)
    second = start_server(other, extra_args=saves)
    proxy = start_proxy(first.url, [second.url], options=[f"spillover_slot_dir={slot_dir}"])
    servers = fingerprinted(proxy, [first.url, second.url])
    differ = {
        key
        for key, value in servers[first.url]["fingerprint"].items()
        if servers[second.url]["fingerprint"][key] != value
    }
    assert {"model", "logits"} <= differ and "tokens" not in differ, differ

    third = start_server("primary", extra_args=saves)
    doctor = subprocess.run(
        [
            sys.executable, "-m", "scripts.doctor", "--servers",
            f"{first.url},{second.url},{third.url}", "--slot-dir", str(slot_dir),
        ],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert f"{first.url} <-> {second.url}: differ in model, logits: replay" in doctor, doctor
    assert f"{first.url} <-> {third.url}: same: KV state moves" in doctor, doctor

    # Long enough that a loaded machine's client, reading its 20th chunk, never finds the
    # whole answer already received (then there would be nothing left to cut).
    body = chat_body(4 * ANSWER, messages=MESSAGES)
    stream = read_stream(proxy.url, body, on_chunk=handoff_after(proxy, 20, hold=first))
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert "not moved: their fingerprints differ in model" in note and "logits" in note, note
    assert slot_files(slot_dir) == []


def test_answers_closed_around_their_migration_leave_nothing_behind(
    start_server, start_proxy, slot_dir: Path
) -> None:
    """STREAMS streams, 4 at a time, each closed by its client 0-120 ms after it asked for a
    handoff of every live answer at its 40th chunk, so that clients go away during the
    moves (finding, saving, restoring, the continuation's start): once they are gone no
    slot file is left in the slot directory and no target slot stays reserved."""
    saves = ["--slot-save-path", str(slot_dir)]
    # A prompt of 1,500 tokens: reading it again costs more than moving it, so it moves.
    first = start_server("primary", ctx_size=4 * 4096, extra_args=saves)
    second = start_server("primary", ctx_size=4 * 4096, extra_args=saves)
    proxy = start_proxy(first.url, [second.url], options=[f"spillover_slot_dir={slot_dir}"])
    fingerprinted(proxy, [first.url, second.url])
    rng = random.Random(23)
    delays = [rng.uniform(0, 0.12) for _ in range(STREAMS)]
    body = long_body(300)

    def one(delay: float) -> None:
        asked = None
        with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=body, timeout=60) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n == 40:
                    httpx.post(f"{proxy.url}/spillover/handoff", timeout=30)
                    asked = time.monotonic()
                if asked is not None and time.monotonic() - asked >= delay:
                    return  # the client goes away

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(one, delays))
    deadline = time.monotonic() + 5
    while True:
        migration = httpx.get(f"{proxy.url}/spillover/status").json()["migration"]
        reserved = {url: s for url, s in migration["reserved"].items() if s}
        if (not reserved and not slot_files(slot_dir)) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    recent = httpx.get(f"{proxy.url}/spillover/status").json()["recent_handoffs"]
    moved = [h for h in recent if (h.get("migration") or {}).get("why", "").startswith("moved")]
    assert moved, migration  # moves were under way, and some ended before their client
    assert slot_files(slot_dir) == [] and reserved == {}, (slot_files(slot_dir), reserved)


# The migrator on its own, against real servers: every step fails or is cancelled in
# turn, and nothing is left behind.


@pytest.fixture
def answered(start_server, slot_dir: Path):
    """A source whose slot holds a finished answer, and a target of the same model."""
    saves = ["--slot-save-path", str(slot_dir)]
    source = start_server("primary", slots=2, extra_args=saves)
    target = start_server("primary", slots=2, extra_args=saves)
    reply = httpx.post(
        f"{source.url}/v1/chat/completions",
        json={**chat_body(40, messages=MESSAGES), "stream": False},
        timeout=30,
    ).json()
    usage = reply["usage"]
    holds = usage["prompt_tokens"] + usage["completion_tokens"] - 1  # the last is not read
    return Upstream(source.url), Upstream(target.url), holds


class Failing(Migrator):
    """A migrator whose `step`-th request to a server fails."""

    def __init__(self, directory: Path, step: int) -> None:
        super().__init__(directory)
        self.step = step
        self.calls = 0

    def _count(self) -> None:
        self.calls += 1
        if self.calls == self.step:
            raise httpx.ConnectError(f"injected at step {self.step}")

    async def _slots(self, server):
        self._count()
        return await super()._slots(server)

    async def _post(self, server, path, filename):
        self._count()
        return await super()._post(server, path, filename)


def test_a_step_that_fails_leaves_nothing_behind(answered, slot_dir: Path) -> None:
    source, target, holds = answered

    async def attempts() -> list:
        outcomes = []
        for step in (1, 2, 3, 4, 5):  # source slots, save, target slots, restore; 5: none
            migrator = Failing(slot_dir, step)
            moved = await migrator.move(source, target, holds)
            outcomes.append(moved)
            assert slot_files(slot_dir) == [], step
            if moved.slot is not None:  # kept for the continuation until it is answered
                assert migrator.reserved[target.url] == {moved.slot}
                migrator.release(target.url, moved.slot)
            assert not any(migrator.reserved.values()), step
            await migrator.close()
        return outcomes

    outcomes = asyncio.run(attempts())
    for step, moved in enumerate(outcomes[:4], 1):
        assert moved.slot is None and f"injected at step {step}" in moved.why, moved
    assert outcomes[4].slot is not None and outcomes[4].why.startswith("restored"), outcomes[4]


def test_a_thousand_migrations_cancelled_anywhere_leave_no_residue(
    answered, slot_dir: Path
) -> None:
    source, target, holds = answered
    rng = random.Random(7)

    async def cycles() -> int:
        migrator = Migrator(slot_dir)
        # Calibrated here (on a warm client): cancels land anywhere from the start of a
        # migration to after its end.
        for _ in range(2):
            started = time.monotonic()
            whole = await migrator.move(source, target, holds)
            took = time.monotonic() - started
            assert whole.slot is not None, whole
            migrator.release(target.url, whole.slot)
        done, since_done = 0, 0
        for _ in range(1000):
            move = asyncio.ensure_future(migrator.move(source, target, holds))
            # A machine that got slower than at calibration widens the window, until
            # moves finish before their cancel again.
            window = 1.5 * took * 2 ** (since_done // 100)
            await asyncio.sleep(rng.uniform(0, window))
            move.cancel()
            # Some are cancelled again while the first cancel is being handled.
            for _ in range(rng.choice((0, 0, 1, 2))):
                await asyncio.sleep(rng.uniform(0, window / 4))
                move.cancel()
            since_done += 1
            try:
                moved = await move
            except asyncio.CancelledError:
                continue
            if moved.slot is not None:
                done, since_done = done + 1, 0
                migrator.release(target.url, moved.slot)
        # Steps a cancel left running end on their own, and clean up after themselves.
        await migrator.close()
        assert slot_files(slot_dir) == []
        assert not any(migrator.reserved.values())
        return done

    done = asyncio.run(cycles())
    assert 0 < done < 1000  # some finished before their cancel, most did not
    slots = httpx.get(f"{target.url}/slots").json()
    assert not any(s["is_processing"] for s in slots)


def test_the_policy_goes_by_the_pauses_it_measured(tmp_path: Path) -> None:
    same = Fingerprint("sha256:ab", 1024, "b1", "t", "ids", "logits")
    other = dataclasses.replace(same, logits="other logits")
    migrator = Migrator(tmp_path)
    target = "http://127.0.0.1:9"
    assert migrator.why_not(same, other, 500, target) == ("their fingerprints differ in logits")
    assert migrator.why_not(same, "cannot be taken: 404", 500, target) == (
        "the target has no fingerprint (cannot be taken: 404)"
    )
    # Nothing measured yet: a few tokens are read again, many move.
    assert migrator.why_not(same, same, 40, target) == (
        "only 40 tokens: reading them again is as quick"
    )
    assert migrator.why_not(same, same, 500, target) is None
    # Measured there: reading costs 0.5 ms a token; a move 20 ms and 0.01 ms a token.
    migrator.rates.learn([(target, 1000, 500.0), (target, 10, 50.0)])  # 10 tokens: too few
    migrator.rates.moved(
        target, Moved(slot=1, tokens=1000, save_ms=5.0, restore_ms=5.0, took_ms=30.0)
    )
    assert migrator.why_not(same, same, 40, target) == (
        "reading 40 tokens again is expected to take 20 ms, moving them 20 ms"
    )
    assert migrator.why_not(same, same, 50, target) is None  # 25 ms to read, 20.5 to move
    assert migrator.rates.status()["read_ms_per_token"] == {target: 0.5}


WORKER = """
import asyncio, sys, time
from pathlib import Path
from addon.handoff.migration import Migrator
from addon.servers.upstream import Upstream

async def main():
    moved = await Migrator(Path(sys.argv[1])).move(
        Upstream(sys.argv[2]), Upstream(sys.argv[3]), int(sys.argv[4])
    )
    print(moved.slot, flush=True)
    time.sleep(600)  # holds its reservation until killed

asyncio.run(main())
"""


def test_workers_sharing_the_slot_directory_never_restore_into_one_anothers_slot(
    answered, slot_dir: Path
) -> None:
    """Two workers (`spillover run --workers`) migrating into one target: each restore
    takes a slot no other worker holds, and a worker's reservations end with it, even
    when it is killed."""
    source, target, holds = answered
    other_worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(slot_dir), source.url, target.url, str(holds)],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        theirs = int(other_worker.stdout.readline())

        async def ours() -> tuple[Moved, Moved, Moved]:
            migrator = Migrator(slot_dir)
            first = await migrator.move(source, target, holds)
            second = await migrator.move(source, target, holds)  # both slots held now
            other_worker.kill()
            other_worker.wait()
            third = await migrator.move(source, target, holds)
            await migrator.close()
            assert not migrator.reserved  # closing gives back what it held
            return first, second, third

        mine, none_left, after_the_kill = asyncio.run(ours())
        assert mine.slot is not None and mine.slot != theirs, (mine, theirs)
        assert none_left.slot is None and "no free slot" in none_left.why, none_left
        assert after_the_kill.slot == theirs, after_the_kill
    finally:
        other_worker.kill()
        other_worker.wait()
