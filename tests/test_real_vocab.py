"""Tiny models with real tokenizers (llama.cpp's vocab-only GGUFs) and their models' real
chat templates (scripts/testbed/realvocab.py), served by llama-server: a primary killed
mid-answer goes on on a fallback of another vocabulary (Llama 3's BPE to Phi-3's
SentencePiece, by text) and of the same one (Qwen 2's, other weights, by token ids).

What the client gets after the cut is compared with the fallback's own continuation of
what the model saw and wrote, computed directly: the fallback's rendering of the
question, then the primary's raw output up to the cut (asked of the primary itself as a
plain `/completion`, which no parser touches) as text, or as the primary's own token ids.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from scripts.testbed import realvocab
from scripts.testbed.llamaserver import LlamaServer
from tests.streams import assert_one_clean_stream, read_stream

QUESTION = [{"role": "user", "content": "Tell me about the river."}]
LIMIT = 60
CUT = 20
SAME_BATCHES = ["--ubatch-size", "32"]  # see test_exact_replay.py


@pytest.fixture(scope="module")
def vocab_models() -> Path:
    return realvocab.CACHED  # written once (about 15 s each: the vocabularies are large)


def serve(start_server, directory: Path, name: str, seed: int) -> LlamaServer:
    model = realvocab.ensure(directory, name, seed)
    return start_server(model, slots=1, extra_args=["--jinja", *SAME_BATCHES])


def rendering(server: LlamaServer) -> str:
    return httpx.post(f"{server.url}/apply-template", json={"messages": QUESTION}).json()["prompt"]


def complete(server: LlamaServer, prompt: list, n_predict: int) -> dict:
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "cache_prompt": False,
            "return_tokens": True}  # fmt: skip
    return httpx.post(f"{server.url}/completion", json=body, timeout=120).json()


@pytest.mark.parametrize(
    ("primary_vocab", "fallback_vocab", "replay"),
    [("llama-bpe", "phi-3", "text"), ("qwen2", "qwen2", "token ids")],
)
def test_a_cut_answer_goes_on_as_the_fallback_would_from_what_the_model_wrote(
    start_server, start_proxy, vocab_models: Path, primary_vocab: str, fallback_vocab: str,
    replay: str,
) -> None:  # fmt: skip
    primary = serve(start_server, vocab_models, primary_vocab, 1)
    fallback = serve(start_server, vocab_models, fallback_vocab, 2)
    # What the model writes, raw: its tokens and their text, before any parser.
    raw = complete(primary, [rendering(primary)], LIMIT)
    proxy = start_proxy(primary.url, [fallback.url])
    known = proxy.servers_known()
    assert (known[primary.url]["tokenizer"] == known[fallback.url]["tokenizer"]) == (
        primary_vocab == fallback_vocab
    )
    body = {"messages": QUESTION, "max_tokens": LIMIT, "temperature": 0, "stream": True,
            "cache_prompt": False, "stream_options": {"include_usage": True}}  # fmt: skip
    stream = read_stream(proxy.url, body, on_chunk=lambda n: n == CUT and primary.kill())
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert f"replayed as {replay}" in note, note
    before, after = stream.segments
    (usage,) = [c["usage"] for c in stream.chunks if c.get("usage")]
    made = usage["spillover"]["legs"][0]["completion_tokens"]
    ids = raw["tokens"][:made]
    again = serve(start_server, vocab_models, primary_vocab, 1)  # the killed one's twin
    written = httpx.post(f"{again.url}/detokenize", json={"tokens": ids}).json()["content"]
    assert written.strip() == before.strip(), (written, before)
    truth = (
        [rendering(fallback), *ids] if replay == "token ids" else [rendering(fallback) + written]
    )
    own = complete(fallback, truth, LIMIT - made)["content"]
    assert after == own
