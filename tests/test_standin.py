"""The benchmarks' stand-in (scripts/testbed/sse_source.py) writes each API's stream as
that API's own client reads it: a paced benchmark of Messages (`scripts.bench.paced --api
messages`) times answers a real client would take whole, through the addon."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest

from scripts.bench.splice import MESSAGES, SseSource
from scripts.parts.processes import running
from scripts.testbed.mitm import Mitmdump

TOKENS = 300


@pytest.fixture
def proxy(server_logs: Path) -> Iterator[Mitmdump]:
    with (
        running(SseSource(log_dir=server_logs)) as (source,),
        running(Mitmdump(source.url, [], log_dir=server_logs)) as (started,),
    ):
        yield started


def test_the_standins_messages_stream_reads_whole_through_anthropics_client(
    proxy: Mitmdump,
) -> None:
    client = anthropic.Anthropic(base_url=proxy.url, api_key="none", max_retries=0)
    with client.messages.stream(
        model="bench", max_tokens=TOKENS, messages=MESSAGES, extra_body={"interval_ms": 0}
    ) as stream:
        deltas = [e.delta.text for e in stream if e.type == "content_block_delta"]
        message = stream.get_final_message()
    assert deltas == [f" w{i}" for i in range(TOKENS)]
    assert message.content[0].text == "".join(deltas)
    assert (message.stop_reason, message.usage.output_tokens) == ("max_tokens", TOKENS)
