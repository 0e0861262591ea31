"""vLLM's CPU build where this machine runs it: a test module that needs it is skipped,
saying why, where it does not."""

from __future__ import annotations

import pytest

from scripts.testbed.vllmserver import VllmUnavailable, ensure_usable


def vllm_or_skip() -> None:
    try:
        ensure_usable()
    except VllmUnavailable as why:
        pytest.skip(f"vLLM's CPU build is not used here: {why}")
