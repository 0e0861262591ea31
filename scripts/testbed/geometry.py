"""Models with the shapes of models people run (Llama 3.1 8B, Llama 3.2 1B) and random
weights: llama-server loads them as it loads the real ones, so memory, load time, prompt
reading, decode steps and KV state are real; the text is not.

The tokenizer is copied whole from a vocab-only GGUF that llama.cpp ships (`llama-bpe`:
Llama 3's 128,256 tokens), the chat template given (Llama 3.1's, from llama.cpp's
`models/templates`). As in tinymodels.py, one hidden dimension holds a constant the
blocks never write, so the output matrix's column for it is a fixed logit bias per token:
control, reserved and byte tokens never come out, answers end only at max_tokens, and
the words are Llama 3's own. The output matrix is never tied to the embeddings (Llama
3.2 1B ties them; here that costs it 0.27 GB more).

Weights are written tensor by tensor (at most the largest tensor in memory: 0.56 GB for
the 8B's embeddings in Q8_0), as Q8_0 blocks or F16 values drawn from one pool of random
bytes, never quantised: an 8B takes about as long as writing 8.5 GB.

    python -m scripts.testbed.geometry 8b models/8b.gguf --vocab ggml-vocab-llama-bpe.gguf \\
        --template meta-llama-Llama-3.1-8B-Instruct.jinja [--type f16]
"""

from __future__ import annotations

import argparse
import hashlib
import math
import struct
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUF_MAGIC, GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType

from scripts.testbed.realvocab import bias_of

BLOCK = 32  # values per Q8_0 block, after its fp16 scale
INT8_STD = math.sqrt((256**2 - 1) / 12)  # uniform random bytes as int8
BIAS_DIM = 0
BIAS_CONSTANT = 4.0  # the embeddings' value in BIAS_DIM (as tinymodels.py)
QK_SCALE, OUT_SCALE = 3.0, 2.0  # as tinymodels.py: sharp attention, readable logits


@dataclass(frozen=True)
class Geometry:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    context: int = 131072
    rope_base: float = 500000.0


GEOMETRIES = {
    "8b": Geometry(n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336),  # Llama 3.1
    "1b": Geometry(n_layer=16, n_embd=2048, n_head=32, n_head_kv=8, n_ff=8192),  # Llama 3.2
    "tiny": Geometry(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, context=8192),
}
TYPES = {"q8_0": GGMLQuantizationType.Q8_0, "f16": GGMLQuantizationType.F16}
FILE_TYPES = {"q8_0": LlamaFileType.MOSTLY_Q8_0, "f16": LlamaFileType.MOSTLY_F16}
COPIED = ("model", "pre", "tokens", "token_type", "merges", "scores", "token_type_count")


class RandomBytes:
    """Random bytes at memory speed: windows of one pool, at random offsets, repeated."""

    def __init__(self, seed: int, pool_mib: int = 64) -> None:
        self.rng = np.random.default_rng(seed)
        self.pool = self.rng.integers(0, 256, size=pool_mib << 20, dtype=np.uint8)

    def take(self, count: int) -> np.ndarray:
        start = int(self.rng.integers(0, len(self.pool) // 2))
        return np.resize(self.pool[start:], count)


class Weights:
    """Matrices (rows x cols, as numpy holds GGUF's ne1 x ne0) of random values with a
    given standard deviation, in one type, with a column or a row set on request."""

    def __init__(self, kind: str, seed: int) -> None:
        self.kind, self.bytes = kind, RandomBytes(seed)

    def matrix(
        self,
        rows: int,
        cols: int,
        std: float,
        column0: np.ndarray | None = None,
        row0_zero: bool = False,
    ) -> np.ndarray:
        if self.kind == "f16":
            values = self._f16(rows, cols, std)
            if column0 is not None:
                values[:, BIAS_DIM] = column0
            if row0_zero:
                values[BIAS_DIM, :] = 0
            return values
        blocks = self.bytes.take(rows * cols // BLOCK * (BLOCK + 2)).reshape(rows, -1, BLOCK + 2)
        scale = std / INT8_STD
        blocks[:, :, :2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
        if column0 is not None:
            _set_first(blocks, column0.astype(np.float32), scale)
        if row0_zero:
            blocks[BIAS_DIM, :, 2:] = 0
        return blocks.reshape(rows, -1)

    def _f16(self, rows: int, cols: int, std: float) -> np.ndarray:
        """Random sign and mantissa, one exponent: magnitudes in [a, 2a), std about 1.53 a."""
        bits = self.bytes.take(rows * cols * 2).view(np.uint16).reshape(rows, cols)
        exponent = min(max(round(math.log2(std / 1.53)) + 15, 1), 30)
        return ((bits & 0x83FF) | np.uint16(exponent << 10)).view(np.float16)


def _set_first(blocks: np.ndarray, values: np.ndarray, scale: float) -> None:
    """Every row's first value to `values` (its block's scale raised where needed, and the
    block's other values lowered to keep theirs)."""
    first = np.maximum(np.abs(values) / 127, scale).astype(np.float16)
    quants = blocks[:, 0, 2:].view(np.int8).astype(np.float32)
    quants *= (scale / first.astype(np.float32))[:, None]
    quants[:, 0] = values / first.astype(np.float32)
    blocks[:, 0, 2:] = np.clip(np.rint(quants), -127, 127).astype(np.int8).view(np.uint8)
    blocks[:, 0, :2] = first.view(np.uint8).reshape(-1, 2)


@dataclass(frozen=True)
class Vocabulary:
    """A vocab-only GGUF's tokenizer.ggml.* fields (key -> (value, GGUF value types)) and
    a chat template: read once (parsing 128k tokens and 280k merges takes seconds) for
    every model written with them."""

    fields: dict[str, tuple[Any, list[GGUFValueType]]]
    template: str
    fingerprint: str

    @classmethod
    def read(cls, vocab: Path, template: str) -> Vocabulary:
        data = vocab.read_bytes()
        fields = {
            key: found
            for key, found in read_kv(data).items()
            if (short := key.removeprefix("tokenizer.ggml.")) != key
            and (short in COPIED or short.endswith("_token_id"))
        }
        return cls(fields, template, hashlib.sha256(data + template.encode()).hexdigest())

    @property
    def bias(self) -> np.ndarray:
        tokens, types = (
            self.fields["tokenizer.ggml.tokens"],
            self.fields["tokenizer.ggml.token_type"],
        )
        return np.asarray(bias_of(tokens[0], types[0]), dtype=np.float32)

    def add_to(self, writer: GGUFWriter) -> None:
        for key, (value, types) in self.fields.items():
            writer.add_key_value(key, value, types[0], types[1] if len(types) > 1 else None)
        writer.add_chat_template(self.template)


SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}  # fmt: skip


def read_kv(data: bytes) -> dict[str, tuple[Any, list[GGUFValueType]]]:
    """A GGUF file's key-value section: key -> (value, value types). gguf's GGUFReader
    takes about 12 s over a 128k vocabulary's 400k strings; this, well under one."""
    magic, version, _, count = struct.unpack_from("<IIQQ", data)
    if magic != GGUF_MAGIC or version < 2:
        raise ValueError(f"not a GGUF v2+ file (magic {magic:#x}, version {version})")
    at, fields = 24, {}

    def string() -> str:
        nonlocal at
        (size,) = struct.unpack_from("<Q", data, at)
        at += 8 + size
        return data[at - size : at].decode()

    def value(kind: GGUFValueType) -> Any:
        nonlocal at
        if kind == GGUFValueType.STRING:
            return string()
        (found,) = struct.unpack_from(SCALARS[kind], data, at)
        at += struct.calcsize(SCALARS[kind])
        return found

    for _ in range(count):
        key = string()
        (kind,) = struct.unpack_from("<I", data, at)
        at += 4
        if kind != GGUFValueType.ARRAY:
            fields[key] = (value(GGUFValueType(kind)), [GGUFValueType(kind)])
            continue
        item, length = struct.unpack_from("<IQ", data, at)
        at += 12
        items = [value(GGUFValueType(item)) for _ in range(length)]
        fields[key] = (items, [GGUFValueType.ARRAY, GGUFValueType(item)])
    return fields


@dataclass(frozen=True)
class Tensor:
    name: str
    rows: int  # 0: a vector of `cols` (a norm's weights: F32 ones)
    cols: int
    std: float = 0.0
    column0: str = ""  # "embed": BIAS_CONSTANT in every row; "bias": each token's logit bias
    row0_zero: bool = False  # the block never writes BIAS_DIM

    def stored(self, kind: str) -> tuple[tuple[int, ...], type, GGMLQuantizationType | None]:
        """Its shape and dtype in the file (Q8_0 as bytes: rows x blocks * 34)."""
        if not self.rows:
            return (self.cols,), np.float32, None
        if kind == "f16":
            return (self.rows, self.cols), np.float16, None
        return (self.rows, self.cols // BLOCK * (BLOCK + 2)), np.uint8, TYPES[kind]

    def data(self, weights: Weights, bias: np.ndarray) -> np.ndarray:
        if not self.rows:
            return np.ones(self.cols, dtype=np.float32)
        first = {"embed": np.full(len(bias), BIAS_CONSTANT, np.float32), "bias": bias}
        column0 = first.get(self.column0)
        return weights.matrix(self.rows, self.cols, self.std, column0, self.row0_zero)


def layout(g: Geometry, n_vocab: int) -> list[Tensor]:
    """Every tensor of a llama-architecture model of this geometry, in the file's order."""
    d, ff, kv = g.n_embd, g.n_ff, g.n_head_kv * (g.n_embd // g.n_head)
    found = [Tensor("token_embd.weight", n_vocab, d, 1.0, column0="embed")]
    for layer in range(g.n_layer):
        at = f"blk.{layer}"
        found += [
            Tensor(f"{at}.attn_norm.weight", 0, d),
            Tensor(f"{at}.attn_q.weight", d, d, QK_SCALE * d**-0.5),
            Tensor(f"{at}.attn_k.weight", kv, d, QK_SCALE * d**-0.5),
            Tensor(f"{at}.attn_v.weight", kv, d, d**-0.5),
            Tensor(f"{at}.attn_output.weight", d, d, 0.5 * d**-0.5, row0_zero=True),
            Tensor(f"{at}.ffn_norm.weight", 0, d),
            Tensor(f"{at}.ffn_gate.weight", ff, d, d**-0.5),
            Tensor(f"{at}.ffn_up.weight", ff, d, d**-0.5),
            Tensor(f"{at}.ffn_down.weight", d, ff, 0.5 * ff**-0.5, row0_zero=True),
        ]
    found.append(Tensor("output_norm.weight", 0, d))
    found.append(Tensor("output.weight", n_vocab, d, OUT_SCALE * d**-0.5, column0="bias"))
    return found


def parameters(g: Geometry, n_vocab: int) -> int:
    return sum(max(t.rows, 1) * t.cols for t in layout(g, n_vocab))


def write(
    path: Path, g: Geometry, vocabulary: Vocabulary, kind: str = "q8_0", seed: int = 0
) -> Path:
    """The model, written aside and moved into place."""
    bias = vocabulary.bias
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    writer = GGUFWriter(str(tmp), "llama")
    writer.add_name(f"geometry-{path.stem}")
    writer.add_context_length(g.context)
    writer.add_embedding_length(g.n_embd)
    writer.add_block_count(g.n_layer)
    writer.add_feed_forward_length(g.n_ff)
    writer.add_head_count(g.n_head)
    writer.add_head_count_kv(g.n_head_kv)
    writer.add_rope_dimension_count(g.n_embd // g.n_head)
    writer.add_rope_freq_base(g.rope_base)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(bias))
    writer.add_file_type(int(FILE_TYPES[kind]))
    vocabulary.add_to(writer)
    planned = layout(g, len(bias))
    for tensor in planned:
        shape, dtype, raw = tensor.stored(kind)
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        writer.add_tensor_info(tensor.name, shape, np.dtype(dtype), nbytes, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    weights = Weights(kind, seed)
    for tensor in planned:
        writer.write_tensor_data(tensor.data(weights, bias))
    writer.close()
    tmp.replace(path)
    return path


def ensure(directory: Path, name: str, vocabulary: Vocabulary, kind: str = "q8_0") -> Path:
    """The model of geometry `name` in `directory`, written once for this source and
    vocabulary."""
    source = Path(__file__).read_bytes() + f"{vocabulary.fingerprint}{name}{kind}".encode()
    path = directory / f"geometry-{name}-{kind}-{hashlib.sha256(source).hexdigest()[:12]}.gguf"
    if not path.exists():
        write(path, GEOMETRIES[name], vocabulary, kind)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("geometry", choices=sorted(GEOMETRIES))
    parser.add_argument("path", type=Path)
    parser.add_argument("--vocab", type=Path, required=True, help="a vocab-only GGUF")
    parser.add_argument("--template", type=Path, required=True, help="a chat template file")
    parser.add_argument("--type", choices=sorted(TYPES), default="q8_0")
    args = parser.parse_args()
    started = time.monotonic()
    g = GEOMETRIES[args.geometry]
    vocabulary = Vocabulary.read(args.vocab, args.template.read_text())
    write(args.path, g, vocabulary, args.type)
    took, size = time.monotonic() - started, args.path.stat().st_size / 2**30
    count = parameters(g, len(vocabulary.bias))
    print(f"{args.path}: {asdict(g)}, {count:,} parameters, {args.type}")
    print(f"{size:.2f} GiB in {took:.1f} s")


if __name__ == "__main__":
    main()
