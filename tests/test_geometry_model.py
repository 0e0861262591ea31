"""Models of a real model's geometry with random weights (scripts/testbed/geometry.py):
the shapes are the named model's, the tokenizer is Llama 3's own, and a real
llama-server loads a small one and answers with it."""

from __future__ import annotations

import httpx
import pytest

from scripts.testbed import geometry
from scripts.testbed.geometry import GEOMETRIES, Vocabulary, parameters
from scripts.testbed.llamacppfiles import folder, vocab
from tests.streams import assert_one_clean_stream, chat_body, read_stream

LLAMA_31_8B_PARAMETERS = 8_030_261_248  # with its own output matrix, as Meta counts it


@pytest.fixture(scope="module")
def vocabulary() -> Vocabulary:
    template = folder() / "templates" / "meta-llama-Llama-3.1-8B-Instruct.jinja"
    return Vocabulary.read(vocab("llama-bpe"), template.read_text())


def test_the_presets_are_the_named_models_shapes(vocabulary: Vocabulary) -> None:
    n_vocab = len(vocabulary.bias)
    assert n_vocab == 128256
    assert parameters(GEOMETRIES["8b"], n_vocab) == LLAMA_31_8B_PARAMETERS
    # Llama 3.2 1B: 1,235,814,400 with its output tied to the embeddings; untied here
    assert parameters(GEOMETRIES["1b"], n_vocab) == 1_235_814_400 + 128256 * 2048


@pytest.mark.parametrize("kind", ["q8_0", "f16"])
def test_a_small_geometry_model_loads_and_answers_with_llama_3s_tokenizer(
    kind: str, vocabulary: Vocabulary, tmp_path_factory, start_server
) -> None:
    tiny = GEOMETRIES["tiny"]
    model = geometry.ensure(tmp_path_factory.getbasetemp() / "geometry", "tiny", vocabulary, kind)
    server = start_server(model, slots=1, extra_args=["--jinja"])
    # llama-server checks every tensor's shape against the metadata (GQA: attn_k and attn_v
    # are n_head_kv heads wide) and counts them
    meta = httpx.get(f"{server.url}/v1/models").json()["data"][0]["meta"]
    assert (meta["n_vocab"], meta["n_embd"]) == (128256, tiny.n_embd)
    assert meta["n_params"] == parameters(tiny, 128256)
    bits = {"q8_0": 8.5, "f16": 16}[kind]  # the norms (F32) are a rounding error
    assert meta["size"] == pytest.approx(meta["n_params"] * bits / 8, rel=0.01)
    ids = httpx.post(f"{server.url}/tokenize", json={"content": "Hello world"}).json()["tokens"]
    assert ids == [9906, 1917]  # Llama 3's own ids
    prompt = httpx.post(
        f"{server.url}/apply-template", json={"messages": chat_body()["messages"]}
    ).json()["prompt"]
    assert prompt.startswith("<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge")

    stream = read_stream(server.url, chat_body(120))
    assert_one_clean_stream(stream)
    assert sum(stream.segment_tokens) == 120  # no end of turn, no control token: all of it
    words = stream.text.split()
    assert len(words) > 40 and all(w.isascii() for w in words), stream.text
