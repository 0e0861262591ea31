"""A tiny vision projector (an mmproj GGUF) for the tiny models, and a tiny picture.

llama-server started with `--mmproj` on one of the tiny models takes `image_url` parts
on its chat route, as a real vision model's does: the projector is a LLaVA-style CLIP
encoder (`clip.projector_type` "mlp": patch embedding, one block, a two-layer MLP into
the text model's width) of seeded noise, so what it "sees" is noise too, but llama.cpp's
mtmd code loads it, encodes a picture into a few embeddings and puts them in the prompt
exactly as it does for a real one. A 16x16 picture makes 4 embeddings.

    python -m scripts.testbed.tinyvision models/primary.mmproj.gguf   # for primary.gguf
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import struct
import zlib
from pathlib import Path

import numpy as np

from scripts.testbed.tinymodels import PRESETS, gguf_file

IMAGE_SIZE = 16
PATCH_SIZE = 8
WIDTH = 32  # the encoder's
FF = 64
SEED = 99


def write_projector(path: Path, text_width: int = PRESETS["primary"].n_embd) -> Path:
    """An mmproj GGUF whose embeddings have `text_width` (the text model's n_embd)."""
    rng = np.random.default_rng(SEED)

    def noise(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * shape[-1] ** -0.5

    patches = (IMAGE_SIZE // PATCH_SIZE) ** 2
    with gguf_file(path, "clip") as writer:
        writer.add_name("tiny-vision")
        writer.add_string("clip.projector_type", "mlp")
        writer.add_bool("clip.has_vision_encoder", True)
        writer.add_bool("clip.use_gelu", True)
        for key, value in (
            ("embedding_length", WIDTH), ("feed_forward_length", FF), ("block_count", 1),
            ("projection_dim", text_width), ("attention.head_count", 1),
            ("image_size", IMAGE_SIZE), ("patch_size", PATCH_SIZE),
        ):  # fmt: skip
            writer.add_uint32(f"clip.vision.{key}", value)
        writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
        writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
        writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])

        writer.add_tensor("v.patch_embd.weight", noise(WIDTH, 3, PATCH_SIZE, PATCH_SIZE))
        writer.add_tensor("v.position_embd.weight", noise(patches, WIDTH))
        for name, rows, cols in (
            ("attn_q", WIDTH, WIDTH), ("attn_k", WIDTH, WIDTH), ("attn_v", WIDTH, WIDTH),
            ("attn_out", WIDTH, WIDTH), ("ffn_up", FF, WIDTH), ("ffn_down", WIDTH, FF),
        ):  # fmt: skip
            writer.add_tensor(f"v.blk.0.{name}.weight", noise(rows, cols))
            writer.add_tensor(f"v.blk.0.{name}.bias", np.zeros(rows, dtype=np.float32))
        for norm in ("ln1", "ln2"):
            writer.add_tensor(f"v.blk.0.{norm}.weight", np.ones(WIDTH, dtype=np.float32))
            writer.add_tensor(f"v.blk.0.{norm}.bias", np.zeros(WIDTH, dtype=np.float32))
        writer.add_tensor("mm.0.weight", noise(FF, WIDTH))
        writer.add_tensor("mm.0.bias", np.zeros(FF, dtype=np.float32))
        writer.add_tensor("mm.2.weight", noise(text_width, FF))
        writer.add_tensor("mm.2.bias", np.zeros(text_width, dtype=np.float32))
    return path


def ensure_projector(directory: Path) -> Path:
    """The projector for the "primary" tiny model in `directory`, written unless an
    identical one is there."""
    path = directory / "primary.mmproj.gguf"
    stamp = path.with_suffix(".gguf.source")
    expected = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    if not path.exists() or not stamp.exists() or stamp.read_text() != expected:
        write_projector(path)
        stamp.write_text(expected)
    return path


def picture(seed: int = 0) -> str:
    """A 16x16 RGB PNG of seeded noise, as the data URL an `image_url` part carries."""
    pixels = np.random.default_rng(seed).integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    rows = b"".join(b"\x00" + row.tobytes() for row in pixels)  # filter 0 on each row

    def chunk(kind: bytes, data: bytes) -> bytes:
        check = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + check

    header = struct.pack(">IIBBBBB", IMAGE_SIZE, IMAGE_SIZE, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows))
    png += chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(png).decode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    print(write_projector(parser.parse_args().path))


if __name__ == "__main__":
    main()
