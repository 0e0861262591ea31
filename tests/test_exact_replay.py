"""Token-exact replay: the fallback goes on from the very token ids the primary produced.

The answers here are pushed (logit_bias) towards word fragments, so the model writes
token sequences its tokenizer would not make of the same text (" th" + "e" rather than
" the"): replaying the text re-tokenizes them and the continuation drifts; replaying the
ids does not.

Both servers run with --ubatch-size 32: llama.cpp's CPU kernels change with the batch
size (here above about 50 tokens), so a prefix recomputed in one big batch can come out a
hair different from the same tokens decoded one by one and flip a near-tie. That is the
engine's batch variance, not the replay; a small ubatch keeps it out of this proof.
"""

from __future__ import annotations

import random
import re

import httpx
import pytest

from scripts.testbed.mitm import Mitmdump
from tests.streams import RawStream, assert_one_clean_stream, chat_body, direct_text, read_stream
from tests.test_splice import handoff_after

CUTS = 100
ANSWER = 64
FRAGMENTS = [" th", " wa", " ri", " mo", " se", " ca", "e", "y", "r", "s", "d", "n"]
SAME_BATCHES = ["--ubatch-size", "32"]


def fragment_bias(server_url: str) -> dict[str, float]:
    ids = [
        httpx.post(f"{server_url}/tokenize", json={"content": f, "with_pieces": True}).json()[
            "tokens"
        ][0]["id"]
        for f in FRAGMENTS
    ]
    return {str(i): 20.0 for i in ids}


NOTE = re.compile(r"after (\d+) tokens .*replayed as (token ids|text)")


def wait_until_known(proxy: Mitmdump, urls: list[str]) -> None:
    """Token ids are asked for only once the addon knows both tokenizers."""
    servers = proxy.servers_known()
    assert all(servers[url]["tokenizer"] for url in urls), servers


@pytest.fixture
def twins(start_server, start_proxy):
    """Two servers running the same model, the second as the first's fallback."""
    first = start_server("primary", extra_args=SAME_BATCHES)
    second = start_server("primary", extra_args=SAME_BATCHES)
    proxy = start_proxy(first.url, [second.url])
    wait_until_known(proxy, [first.url, second.url])
    return first, second, proxy


def cut_stream(proxy: Mitmdump, body: dict, at: int, hold) -> RawStream:
    """A stream of `body` handed off after `at` chunks. On a loaded machine the primary
    may have written the whole (short) answer before the handoff arrives: nothing to cut
    then, so it is read again, as random_cuts does."""
    for _ in range(5):
        stream = read_stream(proxy.url, body, on_chunk=handoff_after(proxy, at, hold=hold))
        assert_one_clean_stream(stream)
        if stream.notes:
            return stream
    raise AssertionError("no handoff landed before the answer ended, 5 times")


def cut_and_replay(stream) -> tuple[int, str]:
    ((at, replay),) = [NOTE.search(note).groups() for note in stream.notes]
    return int(at), replay


def random_cuts(proxy: Mitmdump, body: dict, count: int, seed: int, hold) -> list:
    """Streams of `body` through the proxy, each handed off at a random point, until
    `count` of them were really cut (a handoff that arrives after the primary's last
    token has nothing to cut)."""
    rng = random.Random(seed)
    cut = []
    for _ in range(2 * count):
        on_chunk = handoff_after(proxy, rng.randint(1, ANSWER - 24), hold=hold)
        stream = read_stream(proxy.url, body, on_chunk=on_chunk)
        assert_one_clean_stream(stream)
        if stream.notes:
            cut.append(stream)
            if len(cut) == count:
                return cut
    raise AssertionError(f"only {len(cut)} of {2 * count} streams were cut")


def test_same_model_any_cut_gives_the_uninterrupted_answer(twins) -> None:
    """Greedy decoding, same model both sides: for 100 random cuts the stitched answer is
    the answer the primary gives uninterrupted, token for token."""
    first, _, proxy = twins
    body = chat_body(ANSWER, logit_bias=fragment_bias(first.url))
    whole = direct_text(first.url, ANSWER, logit_bias=body["logit_bias"])
    retokenized = httpx.post(f"{first.url}/tokenize", json={"content": whole}).json()["tokens"]
    assert len(retokenized) < ANSWER  # the model's own tokens are not what its tokenizer makes
    cuts = []
    for stream in random_cuts(proxy, body, CUTS, seed=20261130, hold=first):
        at, replay = cut_and_replay(stream)
        assert replay == "token ids"
        assert stream.text == whole, f"cut after {at} tokens"
        assert sum(stream.segment_tokens) == ANSWER and stream.finishes == ["length"]
        assert all("logprobs" not in choice for c in stream.chunks for choice in c["choices"])
        cuts.append(at)
    assert len(set(cuts)) >= 20, sorted(set(cuts))  # the cuts really land all over the answer


def test_replaying_text_instead_drifts_at_some_cuts(start_server, start_proxy) -> None:
    """The control for the test above: the same cuts with text replay do not all give the
    uninterrupted answer, so the ids are what keeps it exact."""
    first = start_server("primary", extra_args=SAME_BATCHES)
    second = start_server("primary", extra_args=SAME_BATCHES)
    proxy = start_proxy(first.url, [second.url], options=["spillover_exact_replay=false"])
    wait_until_known(proxy, [first.url, second.url])
    body = chat_body(ANSWER, logit_bias=fragment_bias(first.url))
    whole = direct_text(first.url, ANSWER, logit_bias=body["logit_bias"])
    streams = random_cuts(proxy, body, 30, seed=20261130, hold=first)
    assert all(cut_and_replay(stream)[1] == "text" for stream in streams)
    drifted = [stream for stream in streams if stream.text != whole]
    assert drifted, "text replay never drifted: this test would not notice ids being ignored"


def test_a_client_that_asks_for_logprobs_gets_them_from_both_legs(twins) -> None:
    first, _, proxy = twins
    body = chat_body(ANSWER, logprobs=True, top_logprobs=2)
    stream = cut_stream(proxy, body, 10, hold=first)
    assert cut_and_replay(stream)[1] == "token ids"
    assert stream.text == direct_text(first.url, ANSWER)
    content = [c for c in stream.chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    for chunk in content:
        (entry,) = chunk["choices"][0]["logprobs"]["content"]
        assert entry["token"] == chunk["choices"][0]["delta"]["content"]
        assert len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0


def test_usage_counts_the_whole_answer_across_an_exact_replay(twins) -> None:
    first, _, proxy = twins
    body = chat_body(ANSWER, stream_options={"include_usage": True})
    stream = cut_stream(proxy, body, 12, hold=first)
    (usage,) = [c["usage"] for c in stream.chunks if c.get("usage")]
    assert usage["completion_tokens"] == ANSWER
    legs = usage["spillover"]["legs"]
    assert [leg["completion_tokens"] for leg in legs] == stream.segment_tokens
    # The client's prompt, as the primary counts it when it answers whole (the
    # continuation read it plus the replayed ids, which are not the client's).
    whole = read_stream(first.url, body)
    (alone,) = [c["usage"] for c in whole.chunks if c.get("usage")]
    assert usage["prompt_tokens"] == alone["prompt_tokens"]
    assert usage["total_tokens"] == ANSWER + alone["prompt_tokens"]


def test_a_stop_string_after_the_cut_ends_the_answer_where_it_would_have(twins) -> None:
    first, _, proxy = twins
    whole = direct_text(first.url, ANSWER)
    # A word whose first appearance is late in the answer, well after the cut.
    late = [" " + w for w in reversed(whole.split()) if whole.find(" " + w) > len(whole) // 2]
    assert late, f"no word appears first in the second half of {whole!r}"
    stop = late[min(5, len(late) - 1)]
    expected = direct_text(first.url, ANSWER, stop=[stop])
    assert len(expected) < len(whole)
    stream = cut_stream(proxy, chat_body(ANSWER, stop=[stop]), 8, hold=first)
    assert cut_and_replay(stream)[1] == "token ids"
    assert stream.text == expected and stream.finishes == ["stop"]


def test_a_seeded_sampled_answer_is_told_its_seed_starts_over(twins) -> None:
    first, _, proxy = twins
    body = {**chat_body(ANSWER), "temperature": 0.9, "seed": 42}
    stream = cut_stream(proxy, body, 8, hold=first)
    assert "the sampling seed starts over on the new server" in stream.notes[0]
    assert sum(stream.segment_tokens) == ANSWER
