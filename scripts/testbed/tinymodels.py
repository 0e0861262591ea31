"""Write tiny, deterministic llama-architecture GGUF models for tests and the demo.

The weights are seeded noise, so the "answers" are word salad, but llama-server loads
and runs them exactly as it would a real model: same tokenizer code, same chat template
handling, same streaming. Two presets share one vocabulary and one ChatML template:
a "primary" (4 layers x 256) and a smaller "fallback" (2 layers x 128).

One hidden dimension is held constant: the embeddings set it, the blocks never write
it, so the output matrix's column for it acts as a fixed per-token logit bias. That
keeps control, byte and word-fragment tokens out of the output (text stays readable)
and means the model never emits an end-of-turn: answers end at max_tokens or a stop.

Real GGUFs differ in their tokenizer's and template's conventions, and the proofs must
hold for models they were not written for, so the generator makes model families
(`FAMILIES`): "chatml" above (no BOS anywhere), "turns" (another vocabulary and special
tokens, a template that writes `bos_token` itself and `| trim`s each message, and a
tokenizer that adds BOS, as Llama-3's and Gemma's GGUFs do) and "chatml-bos" (ChatML with
no BOS in the template and a tokenizer that adds one, as some converters write it).

    python -m scripts.testbed.tinymodels models/          # writes every preset's model
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The same conversation format, with a reasoning phase the answer opens in: llama-server
# recognises the <think> tags and streams that phase as reasoning_content.
REASONING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% if message['reasoning_content'] %}"
    "{{ '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' }}"
    "{% endif %}"
    "{{ (message['content'] or '') + '<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)

# Another turn format: the template writes BOS itself and trims what each message says.
TURNS_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + (message['content'] | trim) + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

WORDS = """
the of and to in is was it for that with as on be at by this had not are but from or
have an they which one you were her all she there would their we him been has when who
will more no if out so said what up its about into than them can only other new some
could time these two may then do first any my now such like our over man me even most
made after also did many before must through back years where much your way well down
should because each just those people how too little state good very make world still
own see men work long get here between both life being under never day same another know
while last might us great old year off come since against go came right used take three
model answer token stream memory card server light river stone cloud signal garden
window bridge market engine silver quiet bright simple steady gentle careful north south
east west morning evening winter summer ocean forest valley mountain
""".split()  # noqa: SIM905
PUNCTUATION = list(".,;:!?'\"()-")
SPACE = "\u2581"  # SentencePiece's word-boundary marker


@dataclass(frozen=True)
class Family:
    """A tokenizer's and a template's conventions. `specials` open with unk, BOS and EOS;
    `end_of_turn` is the one written as the model's EOS."""

    specials: tuple[str, ...]
    end_of_turn: str
    template: str
    add_bos: bool
    words: tuple[str, ...]


FAMILIES = {
    "chatml": Family(
        ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"), "<|im_end|>", CHATML_TEMPLATE,
        add_bos=False, words=tuple(WORDS),
    ),
    # Another order of words and other special tokens: every id differs from chatml's.
    "turns": Family(
        ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
        "<|end|>", TURNS_TEMPLATE, add_bos=True, words=tuple(sorted(WORDS, key=len)),
    ),
    "chatml-bos": Family(
        ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"), "<|im_end|>", CHATML_TEMPLATE,
        add_bos=True, words=tuple(WORDS),
    ),
}  # fmt: skip
SPECIAL = list(FAMILIES["chatml"].specials)

WORD_BIAS = 0.0
PUNCT_BIAS = -1.0
FRAGMENT_BIAS = -8.0
BANNED_BIAS = -40.0
# Sharp attention keeps greedy decoding of random weights from settling into loops.
QK_SCALE = 3.0
OUT_SCALE = 2.0


@dataclass(frozen=True)
class Preset:
    n_layer: int
    n_embd: int
    n_head: int
    n_ff: int
    seed: int
    context: int = 8192
    family: str = "chatml"


PRESETS = {
    "primary": Preset(n_layer=4, n_embd=256, n_head=4, n_ff=512, seed=1234),
    "fallback": Preset(n_layer=2, n_embd=128, n_head=2, n_ff=256, seed=4321),
    "turns-primary": Preset(n_layer=4, n_embd=256, n_head=4, n_ff=512, seed=1234, family="turns"),
    "turns-fallback": Preset(n_layer=2, n_embd=128, n_head=2, n_ff=256, seed=4321, family="turns"),
    "bos-fallback": Preset(
        n_layer=2, n_embd=128, n_head=2, n_ff=256, seed=4321, family="chatml-bos"
    ),
}
# For benchmarks only (not generated for the tests): wide and deep enough that reading a
# prompt takes visible time on a CPU, with the same vocabulary and template.
BENCH_PRESETS = {
    "medium": Preset(n_layer=6, n_embd=384, n_head=6, n_ff=1024, seed=2468, context=16384),
}


def build_vocab(
    family: Family = FAMILIES["chatml"],
) -> tuple[list[str], list[float], list[int], list[float]]:
    """Tokens, SentencePiece scores, token types and the fixed logit bias of each token."""
    tokens: list[str] = []
    types: list[int] = []
    bias: list[float] = []

    def add(piece: str, kind: TokenType, logit_bias: float) -> None:
        tokens.append(piece)
        types.append(int(kind))
        bias.append(logit_bias)

    add(family.specials[0], TokenType.UNKNOWN, BANNED_BIAS)
    for special in family.specials[1:]:
        add(special, TokenType.CONTROL, BANNED_BIAS)
    for byte in range(256):
        add(f"<0x{byte:02X}>", TokenType.BYTE, BANNED_BIAS)

    seen = set(tokens)
    # Single characters first: SentencePiece merges upward from them.
    alphabet = [SPACE] + [chr(c) for c in range(0x21, 0x7F)]
    for char in alphabet:
        add(char, TokenType.NORMAL, PUNCT_BIAS if char in PUNCTUATION else FRAGMENT_BIAS)
        seen.add(char)
    for word in family.words:
        for spelled in (SPACE + word, word):
            # Every prefix must exist so the greedy pair merges can reach the whole word.
            for end in range(2, len(spelled) + 1):
                piece = spelled[:end]
                if piece in seen:
                    continue
                seen.add(piece)
                whole = piece == SPACE + word
                add(piece, TokenType.NORMAL, WORD_BIAS if whole else FRAGMENT_BIAS)
    # Reasoning tags, last so every other id stays put. The model never opens a reasoning
    # phase itself, and closes one only when a request's logit_bias asks it to.
    add("<think>", TokenType.USER_DEFINED, BANNED_BIAS)
    add("</think>", TokenType.USER_DEFINED, FRAGMENT_BIAS)
    # Longer pieces score higher so merges prefer them.
    scores = [
        0.0 if t != TokenType.NORMAL else float(len(p)) for p, t in zip(tokens, types, strict=True)
    ]
    return tokens, scores, types, bias


def _quantized(writer: GGUFWriter, name: str, matrix: np.ndarray) -> None:
    writer.add_tensor(
        name,
        quantize(matrix.astype(np.float32), GGMLQuantizationType.Q8_0),
        raw_dtype=GGMLQuantizationType.Q8_0,
    )


def write_model(path: Path, preset: Preset) -> Path:
    family = FAMILIES[preset.family]
    tokens, scores, types, bias = build_vocab(family)

    def tokenizer(writer: GGUFWriter) -> None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(family.specials.index(family.end_of_turn))
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(family.add_bos)
        writer.add_add_space_prefix(False)
        writer.add_chat_template(family.template)

    return write_weights(path, preset, tokenizer, bias)


@contextmanager
def gguf_file(path: Path, arch: str) -> Iterator[GGUFWriter]:
    """A GGUF writer whose file, once its tensors are added, is written aside and moved
    into place whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    writer = GGUFWriter(str(tmp), arch)
    yield writer
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)


def write_weights(
    path: Path, preset: Preset, tokenizer: Callable[[GGUFWriter], None], bias: list[float]
) -> Path:
    """A llama-architecture model of `preset`'s shape and seeded noise, its tokenizer
    written by `tokenizer`, each token's fixed logit `bias` in output column 0."""
    n_vocab, d = len(bias), preset.n_embd
    rng = np.random.default_rng(preset.seed)
    # Dimension 0 carries the constant that turns output column 0 into a logit bias.
    bias_dim = 0

    def noise(rows: int, cols: int, scale: float) -> np.ndarray:
        return rng.standard_normal((rows, cols), dtype=np.float32) * scale

    with gguf_file(path, "llama") as writer:
        writer.add_name(f"tiny-{path.stem}")
        writer.add_context_length(preset.context)
        writer.add_embedding_length(d)
        writer.add_block_count(preset.n_layer)
        writer.add_feed_forward_length(preset.n_ff)
        writer.add_head_count(preset.n_head)
        writer.add_head_count_kv(preset.n_head)
        writer.add_rope_dimension_count(d // preset.n_head)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_file_type(int(GGMLQuantizationType.Q8_0))
        tokenizer(writer)

        embed = noise(n_vocab, d, 1.0)
        embed[:, bias_dim] = 4.0
        _quantized(writer, "token_embd.weight", embed)
        for layer in range(preset.n_layer):
            prefix = f"blk.{layer}"
            writer.add_tensor(f"{prefix}.attn_norm.weight", np.ones(d, dtype=np.float32))
            writer.add_tensor(f"{prefix}.ffn_norm.weight", np.ones(d, dtype=np.float32))
            for name in ("attn_q", "attn_k", "attn_v"):
                _quantized(writer, f"{prefix}.{name}.weight", noise(d, d, QK_SCALE * d**-0.5))
            attn_out = noise(d, d, 0.5 * d**-0.5)
            attn_out[bias_dim, :] = 0.0
            _quantized(writer, f"{prefix}.attn_output.weight", attn_out)
            _quantized(writer, f"{prefix}.ffn_gate.weight", noise(preset.n_ff, d, d**-0.5))
            _quantized(writer, f"{prefix}.ffn_up.weight", noise(preset.n_ff, d, d**-0.5))
            ffn_down = noise(d, preset.n_ff, 0.5 * preset.n_ff**-0.5)
            ffn_down[bias_dim, :] = 0.0
            _quantized(writer, f"{prefix}.ffn_down.weight", ffn_down)
        writer.add_tensor("output_norm.weight", np.ones(d, dtype=np.float32))
        output = noise(n_vocab, d, OUT_SCALE * d**-0.5)
        output[:, bias_dim] = np.asarray(bias, dtype=np.float32)
        _quantized(writer, "output.weight", output)
    return path


def ensure_models(directory: Path) -> dict[str, Path]:
    """Write each preset's model into `directory` unless an identical one is there."""
    return {name: ensure_model(directory, name, preset) for name, preset in PRESETS.items()}


def ensure_model(directory: Path, name: str, preset: Preset) -> Path:
    path = directory / f"{name}.gguf"
    if not path.exists() or _fingerprint_of(path) != _expected_fingerprint(name):
        write_model(path, preset)
        _stamp(path).write_text(_expected_fingerprint(name))
    return path


def _stamp(path: Path) -> Path:
    return path.with_suffix(".gguf.source")


def _fingerprint_of(path: Path) -> str | None:
    stamp = _stamp(path)
    return stamp.read_text() if stamp.exists() else None


def _expected_fingerprint(name: str) -> str:
    # Regenerate when this file (vocabulary, layout, presets) changes.
    return hashlib.sha256(Path(__file__).read_bytes() + name.encode()).hexdigest()


def reasoning_template(directory: Path) -> Path:
    """The reasoning chat template as a file, for llama-server's --chat-template-file."""
    path = directory / "reasoning.jinja"
    path.write_text(REASONING_TEMPLATE)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, nargs="?", default=Path("models"))
    args = parser.parse_args()
    for name, path in ensure_models(args.directory).items():
        print(f"{name}: {path} ({path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
