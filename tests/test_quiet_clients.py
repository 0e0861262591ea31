"""The addon's own clients ask its servers every second (health), and at every handoff and
shadow update; mitmproxy's root logger takes every record any library makes and passes
it to each addon. The trace httpcore writes of each request (a dozen debug records,
never shown) must not be made at all."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

COUNTER = """
import collections, json, logging

COUNTS = collections.Counter()


class Count(logging.Handler):
    def emit(self, record):
        COUNTS[f"{record.name} {record.levelname}"] += 1


logging.getLogger().addHandler(Count())


class WriteCounts:
    def done(self):
        with open(%r, "w") as file:
            json.dump(COUNTS, file)


addons = [WriteCounts()]
"""


def test_the_addons_own_requests_make_no_log_records(
    primary, fallback, start_proxy, tmp_path: Path
) -> None:
    counts = tmp_path / "counts.json"
    script = tmp_path / "count_records.py"
    script.write_text(COUNTER % str(counts))
    proxy = start_proxy(primary.url, [fallback.url], scripts=[script])
    assert proxy.servers_known()[fallback.url]["continues"]  # questions asked of both
    time.sleep(2.5)  # health asked of both servers every second
    answer = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=30,
    )
    assert answer.status_code == 200
    proxy.stop()
    made = json.loads(counts.read_text())
    assert any(name.startswith("mitmproxy.") for name in made), made  # the counter counted
    assert not [name for name in made if name.startswith(("httpcore", "httpx"))], made
