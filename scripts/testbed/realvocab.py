"""Tiny models with REAL tokenizers: the vocab-only GGUFs llama.cpp ships
(`models/ggml-vocab-*.gguf`: Llama 3's BPE, Phi-3's SentencePiece with byte fallback,
Qwen 2's BPE), their tokenizer copied whole (model, pre-tokenizer, tokens, types, merges,
scores, special ids), with the matching real chat template from `models/templates` and
the seeded-noise weights of tinymodels.py. The fixed logit bias keeps control, byte and
unused tokens out of the output and prefers whole ASCII words, so answers stay readable.

    python -m scripts.testbed.realvocab models/    # write one model per vocabulary
"""

from __future__ import annotations

import argparse
import hashlib
import re
from pathlib import Path

from gguf import GGUFReader, GGUFWriter, TokenType

from scripts.testbed.llamabin import CACHE
from scripts.testbed.llamacppfiles import folder, vocab
from scripts.testbed.tinymodels import (
    BANNED_BIAS,
    FRAGMENT_BIAS,
    PUNCT_BIAS,
    WORD_BIAS,
    Preset,
    write_weights,
)

# vocabulary -> the template of a model that uses it
VOCABS = {
    "llama-bpe": "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "phi-3": "microsoft-Phi-3.5-mini-instruct.jinja",
    "qwen2": "Qwen-Qwen2.5-7B-Instruct.jinja",
}
CACHED = CACHE / "real-vocab"
SHAPE = Preset(n_layer=2, n_embd=64, n_head=2, n_ff=128, seed=0)
WORD = re.compile(r" ?[a-z]{2,12}")
BANNED = {TokenType.UNKNOWN, TokenType.CONTROL, TokenType.UNUSED, TokenType.BYTE}
COPIED = ("model", "pre", "tokens", "token_type", "merges", "scores")


def _visible(piece: str) -> str:
    """A token's text with the word-boundary marks of BPE (Ġ) and SentencePiece (▁)."""
    return piece.replace("\u0120", " ").replace("\u2581", " ")


def bias_of(tokens: list[str], types: list[int]) -> list[float]:
    bias = []
    for piece, kind in zip(tokens, types, strict=True):
        text = _visible(piece)
        if kind in BANNED or piece.startswith("<|") or piece.startswith("<"):
            bias.append(BANNED_BIAS)
        elif WORD.fullmatch(text):
            bias.append(WORD_BIAS)
        elif text in (".", ","):
            bias.append(PUNCT_BIAS)
        else:
            bias.append(FRAGMENT_BIAS)
    return bias


def write(path: Path, name: str, seed: int) -> Path:
    fields = GGUFReader(vocab(name)).fields

    def value(key: str):
        field = fields.get(f"tokenizer.ggml.{key}")
        return None if field is None else field.contents()

    tokens, types = value("tokens"), value("token_type")
    template = (folder() / "templates" / VOCABS[name]).read_text()

    def tokenizer(writer: GGUFWriter) -> None:
        writer.add_tokenizer_model(value("model"))
        if (pre := value("pre")) is not None:
            writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        if (merges := value("merges")) is not None:
            writer.add_token_merges(merges)
        if (scores := value("scores")) is not None:
            writer.add_token_scores(scores)
        for special, add in (
            ("bos_token_id", writer.add_bos_token_id),
            ("eos_token_id", writer.add_eos_token_id),
            ("unknown_token_id", writer.add_unk_token_id),
            ("padding_token_id", writer.add_pad_token_id),
        ):
            if (found := value(special)) is not None:
                add(int(found))
        for flag, add in (
            ("add_bos_token", writer.add_add_bos_token),
            ("add_eos_token", writer.add_add_eos_token),
            ("add_space_prefix", writer.add_add_space_prefix),
        ):
            if (found := value(flag)) is not None:
                add(bool(found))
        writer.add_chat_template(template)

    preset = Preset(SHAPE.n_layer, SHAPE.n_embd, SHAPE.n_head, SHAPE.n_ff, seed=seed)
    return write_weights(path, preset, tokenizer, bias_of(tokens, types))


def ensure(directory: Path, name: str, seed: int = 1) -> Path:
    """The model of vocabulary `name` and weights `seed` in `directory`, written once."""
    source = Path(__file__).read_text() + (folder() / "templates" / VOCABS[name]).read_text()
    stamp = hashlib.sha256(f"{source}{name}{seed}".encode()).hexdigest()[:12]
    path = directory / f"real-{name}-{seed}-{stamp}.gguf"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        write(path, name, seed)  # written aside and moved into place (write_weights)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, nargs="?", default=Path("models"))
    for name in VOCABS:
        print(ensure(parser.parse_args().directory, name))


if __name__ == "__main__":
    main()
