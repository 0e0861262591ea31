"""The addon's own clients ask its servers what they are, and at every handoff and shadow
update; mitmproxy's root logger takes every record any library makes and passes
it to each addon. The trace httpcore writes of each request (a dozen debug records,
never shown) must not be made at all. And the clients share one TLS context: httpx
builds one for each client otherwise (26 ms of CPU in the event loop, see
addon/servers/tls.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from tests.streams import assert_one_clean_stream, chat_body, read_stream
from tests.test_splice import handoff_after

COUNTER = """
import collections, json, logging

COUNTED = collections.Counter()


class Count(logging.Handler):
    def emit(self, record):
        COUNTED[f"{record.name} {record.levelname}"] += 1


logging.getLogger().addHandler(Count())

"""

# The end of each counting script: what it counted, written at mitmproxy's `done`.
WRITTEN_AT_DONE = """
class WriteCounted:
    def done(self):
        with open(%r, "w") as file:
            json.dump(COUNTED, file)


addons = [WriteCounted()]
"""


def counting_script(counting: str, folder: Path) -> tuple[Path, Path]:
    """An addon script that counts (`counting` fills COUNTED), and the file it writes."""
    counted, script = folder / "counted.json", folder / "count.py"
    script.write_text(counting + WRITTEN_AT_DONE % str(counted))
    return script, counted


def test_the_addons_own_requests_make_no_log_records(
    primary, fallback, start_proxy, tmp_path: Path
) -> None:
    script, counts = counting_script(COUNTER, tmp_path)
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


TLS_COUNTER = """
import json, ssl, sys

COUNTED = []
_make = ssl.create_default_context


def counted(*args, **kwargs):
    COUNTED.append(sys._getframe(1).f_globals.get("__name__"))
    return _make(*args, **kwargs)


ssl.create_default_context = counted

"""


def test_the_addons_clients_share_one_tls_context(
    primary, fallback, start_proxy, tmp_path: Path
) -> None:
    """Its questions at the start, its health checks and a handoff, each by a client of
    its own: none builds a TLS context. The one they share is built as the addon starts
    (its configure, before this counting script is loaded)."""
    script, made = counting_script(TLS_COUNTER, tmp_path)
    proxy = start_proxy(primary.url, [fallback.url], scripts=[script])
    assert proxy.servers_known()[fallback.url]["continues"]
    time.sleep(1.5)  # health asked of both servers every second
    stream = read_stream(proxy.url, chat_body(60), on_chunk=handoff_after(proxy, 10, primary))
    assert_one_clean_stream(stream)
    assert len(stream.notes) == 1
    proxy.stop()
    assert json.loads(made.read_text()) == []
