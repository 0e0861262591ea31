#!/usr/bin/env bash
# Make .venv (Python >= 3.12) with the project and its test extra, and make sure a
# llama-server that runs on this CPU exists, then the other engines and tools the tests
# use. `setup.sh demo`: only what the demo uses (the project, the tiny models' writer and
# llama-server). Safe to run again: quick when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

is_312() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

find_python() {
    local candidate
    # pyenv shims for unselected versions exist but fail, so every candidate is run, not trusted.
    local pyenv_versions=()
    if command -v pyenv >/dev/null 2>&1; then
        pyenv_versions=("$(pyenv root)"/versions/3.*/bin/python3)
    fi
    for candidate in "${PYTHON:-}" python3.14 python3.13 python3.12 python3 \
        "${pyenv_versions[@]}" /usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9]; do
        [ -n "$candidate" ] || continue
        if is_312 "$candidate"; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

if [ ! -x .venv/bin/python ] || ! is_312 .venv/bin/python; then
    python=$(find_python) || {
        echo "setup: need Python >= 3.12 (mitmproxy 12 requires it); set PYTHON=/path/to/python3.12" >&2
        exit 1
    }
    echo "setup: creating .venv with $python"
    rm -rf .venv
    "$python" -m venv .venv
fi

# What is installed: the test extra (a superset of the demo's), unless only the demo runs.
extra=test
[ "${1:-}" = demo ] && ! grep -q ' test$' .venv/.spillover-installed 2>/dev/null && extra=demo
stamp=.venv/.spillover-installed
want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1) $extra"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "setup: installing the project and its $extra extra into .venv"
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$extra]"
    echo "$want" > "$stamp"
fi

.venv/bin/python -m scripts.testbed.llamaserver >/dev/null
[ "${1:-}" = demo ] && exit 0
# The other engine of the tests (built once, about 5 min).
.venv/bin/python -m scripts.testbed.llamacpppython >/dev/null
# vLLM's CPU build, the third engine (installed once, about 12 min; where this machine
# cannot install it, it says why and its tests are skipped with that reason).
.venv/bin/python -m scripts.testbed.vllmserver >/dev/null
# LiteLLM's proxy and RAMP, which docs/beside.md's recipes run beside the proxy (each from
# PyPI into an environment of its own, once: about 2 min; where one cannot be installed,
# its test is skipped with the reason).
.venv/bin/python -m scripts.testbed.beside >/dev/null
# Debian's Prometheus and node_exporter for the fleet tests (apt-get, as root; otherwise
# they are skipped, saying what to install).
.venv/bin/python -m scripts.testbed.fleet || echo "setup: the fleet tests will be skipped"
