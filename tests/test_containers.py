"""Servers in containers (docs/your-cards.md): two real llama-servers in Docker
containers behind published ports, which `docker-proxy` holds. The proxy cannot follow
such a port to a card; named in `spillover_cards`, the primary's card is watched, and
when it fills mid-answer the answer moves to the other container."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from scripts.testbed.containers import (
    DockerUnavailable,
    docker,
    ensure_daemon,
    llama_server_image,
)
from scripts.testbed.llamaserver import find_binary
from scripts.testbed.memfiles import FakeCard
from scripts.testbed.prompts import chat_body
from tests.quickstart import (
    PROXY,
    doc_block,
    quick_start_ports,
    running_as_written,
    wait_until_ready,
    your_models,
)
from tests.streams import assert_one_clean_stream, continuation, read_stream
from tests.throttle import Throttled

CONTAINERS = ("primary", "fallback")  # the names the block gives them
PRIMARY, FALLBACK = "http://127.0.0.1:8081", "http://127.0.0.1:8082"
LONG = 400


@pytest.fixture(scope="module")
def image() -> str:
    """An image of the setup's llama-server, with a docker daemon to run it."""
    try:
        ensure_daemon()
        return llama_server_image(find_binary())
    except DockerUnavailable as why:
        pytest.skip(f"containers do not run here: {why}")


def test_the_container_quick_start_runs_and_a_full_card_moves_the_answer(
    image: str, models: dict[str, Path], tmp_path: Path
) -> None:
    """The block run by bash with its first line (your models, the image) set to the tiny
    models and the test bed's image, without `--gpus device=N` (no GPU or NVIDIA runtime
    here), the cards it names (`nvml:0`, `nvml:1`) the test bed's `drm:card0` and
    `drm:card1` read from files; the rest as written. The doctor says each port is held
    by docker-proxy; the primary's card fills at the 30th chunk, and after the cut the
    client gets the fallback container's own continuation of what it had."""
    sysfs = tmp_path / "sys"
    card0 = FakeCard(sysfs, "card0", 16384, 2048)
    FakeCard(sysfs, "card1", 16384, 2048)
    block = doc_block("docs/your-cards.md", "## Servers in containers")
    assert block.count(" --gpus device=") == 2 and "=nvml:0" in block and "=nvml:1" in block
    script = your_models(block, BIG=models["primary"], SMALL=models["fallback"], IMAGE=image)
    script = re.sub(r" --gpus device=\d", "", script)
    script = script.replace("=nvml:0", "=drm:card0").replace("=nvml:1", "=drm:card1")
    script = script.rstrip("\n")
    script += f" --set spillover_sysfs_root={sysfs} --set spillover_sources=sysfs\n"
    printed = tmp_path / "printed"
    with (
        quick_start_ports(),
        containers_named(CONTAINERS),
        running_as_written(script, tmp_path, {}, output=printed),
    ):
        known = wait_until_ready(PRIMARY, FALLBACK)
        assert known.get(PRIMARY, {}).get("engine") == "llama-server", known
        said = printed.read_text()
        for port in (8081, 8082):
            held = rf"port {port} is held by pid \d+ \(docker-proxy\)"
            assert re.search(held, said), said
        status = httpx.get(f"{PROXY}/spillover/status").json()
        assert "drm:card0" in str(status), status
        # The primary throttled, as on a slow card: unthrottled, the tiny model's answer
        # may all be with the proxy before a loaded machine's client reads 30 chunks.
        primary = int(docker("inspect", "--format", "{{.State.Pid}}", "primary").stdout)
        with Throttled(primary):
            stream = read_stream(
                PROXY, chat_body(LONG), on_chunk=lambda n: n == 30 and card0.set_used(16000)
            )
        assert_one_clean_stream(stream)
        (note,) = stream.notes
        assert f"{PRIMARY} -> {FALLBACK}" in note and "pressure" in note, note
        before, after = stream.segments
        rest = LONG - stream.segment_tokens[0]
        assert before and after == continuation(FALLBACK, before, rest)


@contextmanager
def containers_named(names: tuple[str, ...]) -> Iterator[None]:
    """Containers of these names are the test's to run and remove (skipped where any
    exists already)."""
    existing = docker("ps", "-a", "--format", "{{.Names}}").stdout.split()
    if taken := set(existing) & set(names):
        pytest.skip(f"containers named {sorted(taken)}, which the block uses, exist here")
    try:
        yield
    finally:
        docker("rm", "-f", *names)
