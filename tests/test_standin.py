"""The benchmarks' stand-in (scripts/testbed/sse_source.py) writes each API's stream as
that API's own client reads it: a paced benchmark of Messages or Responses
(`scripts.bench.paced --api messages|responses`) times answers a real client would take
whole, through the addon."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
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


def test_the_standins_responses_stream_reads_whole_through_openais_client(
    proxy: Mitmdump,
) -> None:
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0)
    stream = client.responses.create(
        model="bench", input=MESSAGES[0]["content"], max_output_tokens=TOKENS, stream=True,
        extra_body={"interval_ms": 0},
    )  # fmt: skip
    events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas == [f" w{i}" for i in range(TOKENS)]
    (done,) = [e.response for e in events if e.type == "response.completed"]
    assert done.output_text == "".join(deltas) and done.usage.output_tokens == TOKENS
    assert [e.type for e in events[:4]] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
