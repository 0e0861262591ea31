#!/usr/bin/env bash
# Set up whatever is missing, then run the live demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh demo
exec .venv/bin/python -m scripts.testbed.demo "$@"
