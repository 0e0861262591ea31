#!/usr/bin/env bash
# Set up whatever is missing, then run the whole test suite (extra args go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# The mitmweb screenshot test drives a real browser: Debian's chromium (playwright's own
# browser download needs the internet). Installed when we may; otherwise that test skips.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test: installing chromium for the mitmweb screenshot test"
    apt-get install -y -q chromium fonts-noto-color-emoji >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q chromium fonts-noto-color-emoji >/dev/null; } \
        || echo "test: could not install chromium: the mitmweb test skips (and fails on CI)" >&2
fi

# The live view's test drives scripts.watch in a real tmux.
if ! command -v tmux >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test: installing tmux for the live view test"
    apt-get install -y -q tmux >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q tmux >/dev/null; } \
        || echo "test: could not install tmux: the live view test skips" >&2
fi

exec .venv/bin/python -m pytest "$@"
