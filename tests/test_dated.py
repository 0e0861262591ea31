"""A template that prints the date (Llama 3.2's "Today Date"), served by two llama-servers
whose clocks keep zones 26 hours apart (UTC+14 and UTC-12: never the same date), as a
fallback on another host may: the answer goes on from the prompt the model saw, with the
primary's date, not the fallback's own rendering of the request on its day."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from scripts.testbed.llamacppfiles import templates
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.mitm import Mitmdump
from tests.chat_shapes import SHAPES
from tests.streams import assert_one_clean_stream
from tests.test_raw_output import (
    ANSWER,
    CUT,
    SAME_BATCHES,
    continued,
    pieces,
    read_cut,
    rendered,
    text_of,
)

LLAMA32 = "meta-llama-Llama-3.2-3B-Instruct"


class Zoned(LlamaServer):
    def __init__(self, model: Path, zone: str, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.zone = zone

    def environment(self) -> dict[str, str]:
        return {**os.environ, "TZ": self.zone}


@pytest.fixture
def zoned(models: dict[str, Path], server_logs: Path) -> Iterator[Callable[[str], LlamaServer]]:
    started: list[LlamaServer] = []
    template = {t.stem: t for t in templates()}[LLAMA32]
    args = ["--jinja", "--chat-template-file", str(template), *SAME_BATCHES]

    def start(zone: str) -> LlamaServer:
        server = Zoned(models["primary"], zone, extra_args=args, log_dir=server_logs)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


def test_the_fallback_reads_the_date_the_model_saw(
    zoned: Callable[[str], LlamaServer], start_proxy: Callable[..., Mitmdump]
) -> None:
    first, second = zoned("Etc/GMT-14"), zoned("Etc/GMT+12")
    body = {**SHAPES["plain"], "max_tokens": ANSWER, "stream": True, "temperature": 0}
    saw = rendered(first, body)
    assert saw != rendered(second, body), "both servers print the same date"
    proxy = start_proxy(first.url, [second.url])
    proxy.servers_known()
    wrote = pieces(first, body)
    stream = read_cut(proxy, body, [first], (CUT,))
    assert_one_clean_stream(stream)
    assert "replayed as token ids" in stream.notes[0], stream.notes
    said = stream.segment_tokens[0]
    own = continued(second, [saw, *(piece.id for piece in wrote[:said])], ANSWER - said)
    assert stream.segments[1] == text_of(own) and text_of(own)
