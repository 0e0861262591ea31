"""A real trained model: Gemma 3 270M (scripts/testbed/realmodel.py), served by the
llama-server the setup found, with Gemma's own chat template, as primary and fallback.

- A character its vocabulary lacks is written as four byte tokens, and llama-server sends
  one chunk for them, with one logprobs entry: the last token's id and the character's
  bytes. The addon counts the tokens by the server's own count (asked with the ids),
  gives up the ids (three are missing) and continues from what the model wrote, by text:
  no U+FFFD reaches the client, the budget counts real tokens, and what follows the cut
  is the fallback's own continuation of exactly the rendering and the text, computed
  directly.
- Gemma's attention is sliding-window: llama-server cannot use a restored slot's state
  (it says "forcing full prompt re-processing"). A migration there is described as
  restored and read again, never as moved, and that server gets none from then on.

Every server runs with --ubatch-size 1: with llama-server's default batch the same
prompt gives this model other logits by how it was batched (docs/limits.md), and the
comparisons here are exact. Marked `alone`: the model reads at tens of tokens a second.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.realmodel import gemma, gemma_template
from tests.streams import assert_one_clean_stream, read_stream
from tests.test_splice import CONTROL, handoff_after

pytestmark = pytest.mark.alone
ONE_BY_ONE = ["--ubatch-size", "1", "--jinja", "--chat-template-file"]
BYTE_TOKENS = "𠮷野家🪿🫎𓀀"  # the first, and the last three: four byte tokens each
ASKED = [{"role": "user", "content": f"Repeat exactly, ten times: {BYTE_TOKENS}"}]
LIMIT = 60


@pytest.fixture(scope="module")
def gemma_file() -> Path:
    return gemma()


def serve(start_server, gemma_file: Path, *extra: str) -> LlamaServer:
    args = [*ONE_BY_ONE, str(gemma_template()), *extra]
    return start_server(gemma_file, slots=1, ctx_size=2048, extra_args=args)


def own_continuation(server: LlamaServer, messages: list[dict], written: str, left: int) -> str:
    """What `server` writes after what the model saw (its rendering of `messages`) and
    `written`, asked directly."""
    seen = httpx.post(f"{server.url}/apply-template", json={"messages": messages}).json()
    body = {"prompt": seen["prompt"] + written, "n_predict": left, "temperature": 0,
            "cache_prompt": False}  # fmt: skip
    return httpx.post(f"{server.url}/completion", json=body, timeout=120).json()["content"]


def test_a_character_of_byte_tokens_is_continued_whole(
    start_server, start_proxy, gemma_file: Path
) -> None:
    primary = serve(start_server, gemma_file)
    fallback = serve(start_server, gemma_file)
    proxy = start_proxy(primary.url, [fallback.url])
    known = proxy.servers_known()
    assert known[primary.url]["tokenizer"] == known[fallback.url]["tokenizer"]
    body = {"messages": ASKED, "max_tokens": LIMIT, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    stream = read_stream(proxy.url, body, on_chunk=lambda n: n == 22 and primary.kill())
    assert_one_clean_stream(stream)
    (note,) = stream.notes
    assert "replayed as text" in note, note
    before, after = stream.segments
    assert "\ufffd" not in stream.text
    assert any(len(char.encode()) == 4 for char in before), before
    (usage,) = [c["usage"] for c in stream.chunks if c.get("usage")]
    first, rest = (leg["completion_tokens"] for leg in usage["spillover"]["legs"])
    # The server's own count: one token per chunk, and three more for each character
    # of four byte tokens (whose chunk came with its last).
    fours = sum(1 for char in before if len(char.encode()) == 4)
    assert first == stream.segment_tokens[0] + 3 * fours, (first, stream.segment_tokens)
    # Where the limit ends inside a character, the server's whole answer shows its first
    # byte tokens as U+FFFD; a stream never sends them (nor did the client get them).
    own = own_continuation(fallback, ASKED, before, LIMIT - first)
    assert after == own.removesuffix("\ufffd"), (after, own)
    assert first + rest <= LIMIT


def test_a_restore_onto_a_sliding_window_model_is_read_again_and_said_so(
    start_server, start_proxy, gemma_file: Path, tmp_path: Path
) -> None:
    slots = tmp_path / "slots"
    slots.mkdir()
    saves = ["--slot-save-path", str(slots)]
    primary = serve(start_server, gemma_file, *saves)
    fallback = serve(start_server, gemma_file, *saves)
    proxy = start_proxy(primary.url, [fallback.url], options=[f"spillover_slot_dir={slots}"])
    known = proxy.servers_known()
    assert known[fallback.url]["fingerprint"] == known[primary.url]["fingerprint"]
    story = [{"role": "user", "content": " ".join(["Tell me about the river and the bridge."] * 8)}]
    body = {"messages": story, "max_tokens": 40, "temperature": 0, "stream": True}
    first = read_stream(proxy.url, body, on_chunk=handoff_after(proxy, 10, hold=primary))
    assert_one_clean_stream(first)
    (note,) = first.notes
    assert "replayed as token ids" in note, note
    assert re.search(r"restored \d+ tokens' KV state, but the server read them again", note), note
    assert "moved" not in note, note
    status = CONTROL.get(f"{proxy.url}/spillover/status").json()
    assert fallback.url in status["migration"]["read_again_on"], status["migration"]
    # The next answer is not migrated there: it replays at once.
    second = read_stream(proxy.url, body, on_chunk=handoff_after(proxy, 10, hold=primary))
    assert_one_clean_stream(second)
    (note,) = second.notes
    assert "not moved: its last restore was read again" in note, note
