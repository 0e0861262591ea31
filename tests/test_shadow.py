"""Shadow prefill with real llama-servers: the next server's cache holds the answer so far,
so a handoff computes only the last few tokens, says the same, and a shadow that fails
or hangs changes nothing for the answer.

The twins run the same model with --ubatch-size 32 (see test_exact_replay.py): a prefix
computed in shadow updates and one computed at once then use the same kernels, so the
continuation must be the same text either way."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.memfiles import FakeCard
from scripts.testbed.mitm import Mitmdump, watch_sysfs
from scripts.testbed.replay import leg_flows, legs_to
from scripts.testbed.victims import changed, victim_body
from tests.streams import RawStream, assert_one_clean_stream, read_stream
from tests.test_exact_replay import SAME_BATCHES, wait_until_known
from tests.test_splice import handoff, held

CONTROL = httpx.Client(timeout=10)
# The tests hold the primary while a shadow catches up, on a machine that may be busy.
NO_STALLS = ["spillover_stall_s=0", "spillover_slow_percent=0", "spillover_health_s=0"]
ANSWER = 300
CUT = 120


def long_body(max_tokens: int = ANSWER) -> dict:
    """A prompt of about 1,500 tokens, so that reading it is real work."""
    words = " ".join(f"river{i % 50} stone" for i in range(750))
    return {
        "messages": [{"role": "user", "content": f"Remember these words: {words}. Go on."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }


def live(proxy: Mitmdump) -> list[dict]:
    return CONTROL.get(f"{proxy.url}/spillover/status").json()["live"]


def wait_for_shadow(proxy: Mitmdump, produced: int, timeout: float = 60) -> dict:
    """The live answer's shadow once its slot holds all but the last few tokens."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answers = live(proxy)
        shadow = answers[0]["shadow"] if answers else None
        if shadow and shadow["covered_tokens"] > produced - 32:
            return shadow
        time.sleep(0.02)
    raise AssertionError(f"the shadow never caught up: {live(proxy)}")


def last_timings(stream: RawStream) -> dict:
    return next(c["timings"] for c in reversed(stream.chunks) if "timings" in c)


def cut_while_held(
    proxy: Mitmdump,
    primary,
    shadowed: bool,
    before: Callable[[], None] = lambda: None,
    replayed: str = "token ids",
) -> RawStream:
    """Stream the long answer; after CUT chunks hold the primary, (with a shadow: wait
    until it has caught up), call `before`, hand off, release. The answer is `replayed`
    so, its note says."""

    def on_chunk(n: int) -> None:
        if n == CUT:
            with held(primary):
                if shadowed:
                    wait_for_shadow(proxy, live(proxy)[0]["tokens"])
                before()
                handoff(proxy, reason="test")

    stream = read_stream(proxy.url, long_body(), on_chunk=on_chunk)
    assert_one_clean_stream(stream)
    assert len(stream.notes) == 1 and f"replayed as {replayed}" in stream.notes[0]
    return stream


@pytest.fixture(scope="module")
def twins(start_server_module, start_proxy_module):
    first = start_server_module("primary", ctx_size=16384, slots=2, extra_args=SAME_BATCHES)
    second = start_server_module("primary", ctx_size=16384, slots=2, extra_args=SAME_BATCHES)
    proxies = {
        mode: start_proxy_module(
            first.url, [second.url], options=[f"spillover_shadow={mode}", *NO_STALLS]
        )
        for mode in ("always", "off")
    }
    for proxy in proxies.values():
        wait_until_known(proxy, [first.url, second.url])
    return first, second, proxies


def test_a_shadowed_handoff_reads_only_the_tail_and_says_the_same(
    twins, start_proxy, tmp_path: Path
) -> None:
    """The shadow's target is sent the prompt again and again: after its first update,
    as its own ids of the rendering, and the continuation too. The same tokens: the
    continuation finds them in the slot, and says what the one sent as text says."""
    first, second, proxies = twins
    flows = tmp_path / "flows.mitm"
    recorded = [f"save_stream_file={flows}", "spillover_shadow=always", *NO_STALLS]
    proxy = start_proxy(first.url, [second.url], options=recorded)
    wait_until_known(proxy, [first.url, second.url])
    cold = cut_while_held(proxies["off"], first, shadowed=False)
    warm = cut_while_held(proxy, first, shadowed=True)
    assert warm.text == cold.text  # the same continuation, shadow or not
    cold_read, warm_read = last_timings(cold), last_timings(warm)
    prompt = cold_read["prompt_n"] + cold_read.get("cache_n", 0)
    assert prompt > 1500  # the whole prompt and answer so far...
    assert warm_read["cache_n"] >= prompt - 40  # ...was in the shadow's slot already
    assert warm_read["prompt_n"] <= 40  # only the tail was read at the handoff
    proxy.stop()  # the recording is whole
    (leg,) = legs_to(flows, second.port)
    rendering = CONTROL.post(f"{second.url}/apply-template", json=long_body()).json()["prompt"]
    tokens = {"content": rendering, "add_special": True}
    own = CONTROL.post(f"{second.url}/tokenize", json=tokens).json()["tokens"]
    assert all(type(token) is int for token in leg["prompt"])
    assert leg["prompt"][: len(own)] == own  # its own ids of the rendering...
    assert len(leg["prompt"]) == len(own) + warm.segment_tokens[0]  # ...and the answer's


def test_shadows_end_with_their_answers(twins) -> None:
    _, second, proxies = twins
    proxy = proxies["always"]
    stream = read_stream(proxy.url, long_body(200))
    assert_one_clean_stream(stream)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        shadowing = CONTROL.get(f"{proxy.url}/spillover/status").json()["shadows"]["shadowing"]
        idle = all(not s["is_processing"] for s in CONTROL.get(f"{second.url}/slots").json())
        if not shadowing and idle:
            return
        time.sleep(0.05)
    raise AssertionError(f"still shadowing: {shadowing}, fallback idle: {idle}")


def test_a_hung_or_dead_shadow_target_changes_nothing(start_server, start_proxy) -> None:
    """The fallback stops (SIGSTOP) under a shadow update, then dies: the answer on the
    primary goes on as through a proxy that shadows nothing."""
    primary = start_server("primary", ctx_size=16384, slots=2, extra_args=SAME_BATCHES)
    fallback = start_server("fallback", ctx_size=16384, slots=2)
    plain = start_proxy(primary.url, [fallback.url], options=["spillover_shadow=off"])
    proxy = start_proxy(primary.url, [fallback.url], options=["spillover_shadow=always"])
    for each in (plain, proxy):
        each.servers_known()
    expected = read_stream(plain.url, long_body(600)).text

    def on_chunk(n: int) -> None:
        if n == 50:
            with held(fallback):
                time.sleep(0.5)  # the primary streams on meanwhile
        if n == 300:
            fallback.stop()

    stream = read_stream(proxy.url, long_body(600), on_chunk=on_chunk)
    assert_one_clean_stream(stream)
    assert stream.notes == [] and stream.text == expected


def test_a_server_that_does_not_list_its_slots_is_not_shadowed(start_server, start_proxy) -> None:
    primary = start_server("primary", ctx_size=16384, slots=2)
    fallback = start_server("fallback", ctx_size=16384, slots=2, extra_args=["--no-slots"])
    proxy = start_proxy(
        primary.url, [fallback.url], options=["spillover_shadow=always", *NO_STALLS]
    )
    proxy.servers_known()

    def on_chunk(n: int) -> None:
        if n == 30:
            with held(primary):
                deadline = time.monotonic() + 5
                while not CONTROL.get(f"{proxy.url}/spillover/status").json()["shadows"][
                    "not_shadowed"
                ]:
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
                handoff(proxy, reason="test")

    stream = read_stream(proxy.url, long_body(600), on_chunk=on_chunk)
    assert_one_clean_stream(stream)
    assert len(stream.notes) == 1 and sum(stream.segment_tokens) == 600
    why = CONTROL.get(f"{proxy.url}/spillover/status").json()["shadows"]["not_shadowed"]
    assert "its slots cannot be listed (HTTP" in why[fallback.url]


def test_near_a_line_shadows_and_clear_of_it_stops(
    start_server, start_proxy, tmp_path: Path
) -> None:
    primary = start_server("primary", ctx_size=16384, slots=2)
    fallback = start_server("fallback", ctx_size=16384, slots=2)
    sysfs = tmp_path / "sys"
    card0 = FakeCard(sysfs, "card0", total_mib=16384, used_mib=10000)  # 6,384 free: near
    FakeCard(sysfs, "card1", total_mib=16384, used_mib=1000)
    on = {primary.url: "drm:card0", fallback.url: "drm:card1"}
    options = [*watch_sysfs(sysfs, on), "spillover_shadow=near", *NO_STALLS]
    proxy = start_proxy(primary.url, [fallback.url], options=options)
    proxy.servers_known()
    seen: dict[str, dict] = {}

    def on_chunk(n: int) -> None:
        if n == 30:
            with held(primary):
                seen["near"] = wait_for_shadow(proxy, live(proxy)[0]["tokens"])
                card0.set_used(1000)  # 15 GiB free: far from every line
                deadline = time.monotonic() + 5
                while (shadow := live(proxy)[0]["shadow"])["ended"] is None:
                    assert time.monotonic() < deadline, shadow
                    time.sleep(0.02)
                seen["far"] = shadow

    stream = read_stream(proxy.url, long_body(400), on_chunk=on_chunk)
    assert_one_clean_stream(stream)
    assert stream.notes == []
    assert seen["near"]["server"] == fallback.url
    assert seen["far"]["ended"] == "no longer wanted there"


VICTIMS = 3  # the fallback's own clients, asking one after another beside the shadows
VICTIM_TOKENS = 200


def test_shadow_updates_never_change_another_answer(start_server, start_proxy) -> None:
    """While three shadowed answers keep updating their shadows on the fallback, three of
    the fallback's own clients ask there one request after another (landing, by
    llama-server's own choice, in slots the shadows used between their updates): each
    answer has all its tokens, and each token is the one the same request made alone
    gets (up to a tie: see scripts/testbed/victims.py). Pinned updates changed such answers."""
    primary = start_server("primary", ctx_size=4 * 4096, slots=4)
    fallback = start_server("fallback", ctx_size=4 * 4096, slots=4)
    proxy = start_proxy(
        primary.url, [fallback.url],
        options=[
            "spillover_shadow=always", "spillover_shadow_max=4", "spillover_shadow_every=4",
            *NO_STALLS,
        ],
    )  # fmt: skip
    proxy.servers_known()
    client = httpx.Client(timeout=120)

    def ask(index: int) -> dict:
        body = victim_body(index, VICTIM_TOKENS)
        return client.post(f"{fallback.url}/completion", json=body).json()

    alone = [ask(i) for i in range(VICTIMS)]
    streams: dict[int, RawStream] = {}
    answers: list[tuple[int, dict]] = []
    errors: list[BaseException] = []

    def shadowed(index: int) -> None:
        try:
            body = {**long_body(400), "ignore_eos": True}  # long enough on a fast machine
            body["messages"][0]["content"] += f" ({index})"
            streams[index] = read_stream(proxy.url, body, timeout=120)
        except Exception as exc:  # (failed below, in the test's thread)
            errors.append(exc)

    def victim(index: int, until: threading.Event) -> None:
        try:
            while not until.is_set():
                answers.append((index, ask(index)))
        except Exception as exc:
            errors.append(exc)

    answering = [threading.Thread(target=shadowed, args=(i,)) for i in range(3)]
    for thread in answering:
        thread.start()
    updates: dict[str, int] = {}
    deadline = time.monotonic() + 60
    while sum(1 for n in updates.values() if n) < 2:  # the shadows are under way
        assert time.monotonic() < deadline and not errors, (updates, errors)
        assert any(t.is_alive() for t in answering), f"answers ended first: {updates}"
        for answer in live(proxy):
            if answer["shadow"]:
                updates[answer["flow"]] = answer["shadow"]["updates"]
        time.sleep(0.02)
    before_victims = dict(updates)
    done = threading.Event()
    asking = [threading.Thread(target=victim, args=(i, done)) for i in range(VICTIMS)]
    for thread in asking:
        thread.start()
    while any(thread.is_alive() for thread in answering):
        for answer in live(proxy):
            if answer["shadow"]:
                updates[answer["flow"]] = answer["shadow"]["updates"]
        time.sleep(0.02)
    done.set()
    for thread in asking:
        thread.join()
    assert not errors, errors
    for stream in streams.values():
        assert_one_clean_stream(stream)
        assert stream.notes == []
    print(f"\n{len(answers)} victims, {sum(updates.values())} updates")
    assert len(answers) >= 2 * VICTIMS, len(answers)  # asked beside the shadows
    for index, answer in answers:
        assert changed(answer, alone[index], VICTIM_TOKENS) is None, index
    # Updates landed beside the victims, on every shadowed answer (how many in all
    # depends on the machine's pace: 39-61 in runs here).
    beside = {flow: n - before_victims.get(flow, 0) for flow, n in updates.items()}
    assert len(beside) == 3 and min(beside.values()) >= 2, (before_victims, updates)
    log = fallback.log_path.read_text()
    assert "selected slot by id" not in log  # no request of the addon's named a slot


def test_a_shadowed_continuation_sent_beside_its_recheck_is_dropped_where_the_server_changed(
    models, server_logs: Path, start_server, start_proxy, tmp_path: Path
) -> None:
    """With a shadow's slot holding the answer, the continuation goes out while the
    recheck runs. Here the fallback was restarted on its port after it was proven (the
    same model, another context size: what it says it runs changed), with nothing to
    tell the proxy but that recheck: the leg sent beside it is dropped unread, the
    server is learnt again, and the continuation is built and sent again. What the
    client reads after the cut is the server's own continuation of that request."""
    primary = start_server("primary", ctx_size=16384, slots=2, extra_args=SAME_BATCHES)
    fallback = start_server("primary", ctx_size=16384, slots=2, extra_args=SAME_BATCHES)
    flows = tmp_path / "flows.mitm"
    options = [f"save_stream_file={flows}", "spillover_shadow=always", *NO_STALLS]
    proxy = start_proxy(primary.url, [fallback.url], options=options)
    wait_until_known(proxy, [primary.url, fallback.url])
    fallback.stop()
    # One slot, held by the leg sent beside the recheck: learnt again once that is dropped.
    restarted = LlamaServer(
        models["primary"], port=fallback.port, ctx_size=6144, slots=1,
        extra_args=SAME_BATCHES, log_dir=server_logs,
    ).start()  # fmt: skip
    try:
        stream = cut_while_held(proxy, primary, shadowed=True)
        assert proxy.servers_known()[fallback.url]["slot_context"] == 6144  # learnt again
        proxy.stop()  # the recording is whole
        dropped, sent = leg_flows(flows, fallback.port)
        assert "the server changed" in dropped.metadata["spillover_exchange"]["error"]
        assert sent.metadata["spillover_exchange"]["outcome"] == "complete"
        body = json.loads(sent.request.content or b"")
        rest = ANSWER - stream.segment_tokens[0]
        own = CONTROL.post(
            f"{restarted.url}/completion",
            json={**body, "stream": False, "n_predict": rest, "n_probs": 0},
        ).json()["content"]
        assert stream.segments[1] == own
    finally:
        restarted.stop()


def test_a_declined_handoff_leaves_the_shadow_going_on(start_server, start_proxy) -> None:
    """No shadow update starts while a handoff is decided. Here the decision declines (the
    fallback's slot is too small for the rest of the answer, which only counting its
    continuation shows): the answer stays whole on the primary, and the shadow goes on
    keeping up with it."""
    primary = start_server("primary", ctx_size=16384, slots=2, extra_args=SAME_BATCHES)
    # 3,400 tokens a slot: the prompt (about 2,900 with its template on this model) and
    # the answer so far fit, the rest of a 1,100-token answer does not.
    fallback = start_server("primary", ctx_size=6800, slots=2, extra_args=SAME_BATCHES)
    plain = start_proxy(primary.url, [fallback.url], options=["spillover_shadow=off"])
    proxy = start_proxy(
        primary.url, [fallback.url], options=["spillover_shadow=always", *NO_STALLS]
    )
    for each in (plain, proxy):
        wait_until_known(each, [primary.url, fallback.url])
    expected = read_stream(plain.url, long_body(1100)).text
    seen: dict[str, dict] = {}

    def on_chunk(n: int) -> None:
        if n == CUT:
            with held(primary):
                seen["before"] = wait_for_shadow(proxy, live(proxy)[0]["tokens"])
                assert handoff(proxy, reason="test") == 0
        if n == CUT + 200:
            with held(primary):
                seen["after"] = wait_for_shadow(proxy, live(proxy)[0]["tokens"], timeout=20)

    stream = read_stream(proxy.url, long_body(1100), on_chunk=on_chunk)
    assert_one_clean_stream(stream)
    assert stream.notes == [] and stream.text == expected
    (declined,) = CONTROL.get(f"{proxy.url}/spillover/status").json()["declined_handoffs"]["recent"]
    assert "tokens per slot, the rest of this answer needs" in declined["why"], declined
    assert seen["after"]["updates"] > seen["before"]["updates"]
    assert seen["after"]["covered_tokens"] > CUT + 150
