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

# The workers' tests run HAProxy, Debian's package, in front of the proxies.
if ! command -v haproxy >/dev/null 2>&1 && [ ! -x /usr/sbin/haproxy ] && [ "$(id -u)" = 0 ] \
    && command -v apt-get >/dev/null; then
    echo "test: installing haproxy for the workers' tests"
    apt-get install -y -q haproxy >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q haproxy >/dev/null; } \
        || echo "test: could not install haproxy: the workers' tests skip" >&2
fi

# Most tests wait on real servers, so they run in parallel: one worker per core and one
# more (SPILLOVER_TEST_WORKERS to choose), each test file on one worker so its servers
# start once. The few marked `alone` take real system RAM, which every proxy's watcher
# reads, so they run afterwards by themselves. The slowest tests are listed each time.
workers=${SPILLOVER_TEST_WORKERS:-$(( $(nproc) + 1 ))}
status=0
.venv/bin/python -m pytest -n "$workers" --dist loadfile -m "not alone" --durations=30 "$@" \
    || status=$?
alone=0
.venv/bin/python -m pytest -m alone --durations=5 "$@" || alone=$?
# 5: no test of this part was chosen (extra arguments named others).
for code in "$status" "$alone"; do
    if [ "$code" != 0 ] && [ "$code" != 5 ]; then exit "$code"; fi
done
if [ "$status" = 5 ] && [ "$alone" = 5 ]; then exit 5; fi
