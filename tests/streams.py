"""Reading a chat stream the way a strict client would, and what the answer should be."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from scripts.testbed.prompts import PROMPT, chat_body


@dataclass
class RawStream:
    """Everything a stream carried, in order: data chunks, comment notes, [DONE]s."""

    status: int = 0
    chunks: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    done: int = 0
    segments: list[str] = field(default_factory=lambda: [""])  # text between notes
    segment_tokens: list[int] = field(default_factory=lambda: [0])
    note_at: list[int] = field(default_factory=list)  # chunks received before each note
    pieces: list[list[str]] = field(default_factory=lambda: [[]])  # content deltas by segment
    thoughts: list[str] = field(default_factory=lambda: [""])  # reasoning between notes

    @property
    def text(self) -> str:
        return "".join(self.segments)

    @property
    def role_deltas(self) -> int:
        return sum(1 for c in self.chunks for ch in c["choices"] if ch.get("delta", {}).get("role"))

    @property
    def finishes(self) -> list[str]:
        return [
            ch["finish_reason"] for c in self.chunks for ch in c["choices"] if ch["finish_reason"]
        ]


def read_stream(
    url: str,
    body: dict[str, Any],
    on_chunk: Callable[[int], None] | None = None,
    timeout: float = 60,
    path: str = "/v1/chat/completions",
    headers: dict[str, str] | None = None,
) -> RawStream:
    """POST a streaming request and record every event; `on_chunk(n)` after each chunk."""
    stream = RawStream()
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=timeout) as r:
        stream.status = r.status_code
        if r.status_code != 200:
            r.read()
            stream.errors.append(r.json())
            return stream
        for line in r.iter_lines():
            record(stream, line)
            if line.startswith("data: {") and on_chunk is not None:
                on_chunk(len(stream.chunks))
    return stream


def recorded_stream(body: bytes) -> RawStream:
    """A stream's body as a recording kept it, read as `read_stream` reads one live."""
    stream = RawStream()
    for line in body.decode().splitlines():
        record(stream, line)
    return stream


def record(stream: RawStream, line: str) -> None:
    if line.startswith(":"):
        stream.notes.append(line)
        stream.note_at.append(len(stream.chunks))
        stream.segments.append("")
        stream.segment_tokens.append(0)
        stream.pieces.append([])
        stream.thoughts.append("")
    elif line == "data: [DONE]":
        stream.done += 1
    elif line.startswith("data: "):
        payload = json.loads(line[6:])
        if "error" in payload:
            stream.errors.append(payload)
            return
        stream.chunks.append(payload)
        for choice in payload["choices"]:
            delta = choice.get("delta", {})
            if text := delta.get("content") or choice.get("text"):
                stream.segments[-1] += text
                stream.pieces[-1].append(text)
            if thought := delta.get("reasoning_content") or delta.get("reasoning"):
                stream.thoughts[-1] += thought
            if text or thought:
                stream.segment_tokens[-1] += 1


def direct_text(server_url: str, max_tokens: int, **extra: Any) -> str:
    body = {**chat_body(max_tokens, **extra), "stream": False}
    reply = httpx.post(f"{server_url}/v1/chat/completions", json=body, timeout=60).json()
    return reply["choices"][0]["message"]["content"]


def continuation(server_url: str, prefill: str, max_tokens: int) -> str:
    """What `server` writes after `prefill`, asked independently of the addon: what the
    model saw (the server's own rendering of the question, its generation prompt
    included) and `prefill` as it wrote it, as a raw /completion (which never echoes)."""
    return complete_after(server_url, prefill, max_tokens)["content"]


def complete_after(server_url: str, prefill: str, max_tokens: int, **extra: Any) -> dict:
    rendered = httpx.post(f"{server_url}/apply-template", json={"messages": PROMPT}).json()
    body = {
        "prompt": rendered["prompt"] + prefill,
        "n_predict": max_tokens,
        "temperature": 0,
        "cache_prompt": False,
        **extra,
    }
    return httpx.post(f"{server_url}/completion", json=body, timeout=60).json()


def assert_one_clean_stream(stream: RawStream) -> None:
    assert stream.status == 200
    assert stream.done == 1, "exactly one [DONE]"
    assert stream.role_deltas == 1, "exactly one role delta"
    assert len(stream.finishes) == 1, stream.finishes
    assert not stream.errors
    assert len({c["id"] for c in stream.chunks}) == 1, "one id for the whole answer"
    # llama-server stamps each chunk with the current second; continuation legs carry the
    # first chunk's stamp.
    # (A note that the answer started elsewhere is not a handoff: that leg is not rewritten.)
    cuts = [at for note, at in zip(stream.notes, stream.note_at, strict=True) if "handoff" in note]
    spliced = stream.chunks[cuts[0] :] if cuts else []
    assert all(c["created"] == stream.chunks[0]["created"] for c in spliced)


def assert_exact_splice(
    stream: RawStream, primary_url: str, fallback_url: str, max_tokens: int
) -> None:
    """The primary's text up to the cut, then exactly the fallback's own continuation."""
    before, after = stream.segments
    assert direct_text(primary_url, max_tokens).startswith(before)
    left = max_tokens - stream.segment_tokens[0]
    assert after == continuation(fallback_url, before, left)
    assert sum(stream.segment_tokens) == max_tokens


def solo_steps(server_url: str, max_tokens: int) -> list[dict[str, Any]]:
    """The server's answer decoded alone, with its two best candidates at each step."""
    return complete_after(server_url, "", max_tokens, n_probs=2)["completion_probabilities"]


def assert_splice_up_to_ties(
    stream: RawStream,
    alone: list[dict[str, Any]],
    fallback_url: str,
    max_tokens: int,
    tie: float = 0.1,
) -> None:
    """Like assert_exact_splice, for answers decoded in a busy batch: llama-server is not
    batch-invariant, so a token whose two best candidates were tied (log-probabilities
    within `tie`; flips seen with gaps up to 0.06) may come out as the runner-up; each
    server's text may part from its answer decoded alone (`alone`: the primary's
    `solo_steps`) there, nowhere else."""
    before = stream.segments[0]
    _same_up_to_ties(stream.pieces[0], alone, tie, "the primary's part", whole=False)
    assert sum(stream.segment_tokens) == max_tokens
    left = max_tokens - stream.segment_tokens[0]
    reply = complete_after(fallback_url, before, left, n_probs=2)
    _same_up_to_ties(stream.pieces[1], reply["completion_probabilities"], tie, "the rest")


def _same_up_to_ties(
    got: list[str], steps: list[dict[str, Any]], tie: float, what: str, whole: bool = True
) -> None:
    """`got` follows the tokens of `steps` (a solo answer with its two best candidates at
    each step) until it ends (`whole`: with them) or takes a tied runner-up once."""
    for index, (token, step) in enumerate(zip(got, steps, strict=False)):
        if token == step["token"]:
            continue
        best, second = step["top_logprobs"][:2]
        gap = best["logprob"] - second["logprob"]
        assert gap < tie and token == second["token"], (
            f"token {index} of {what}: got {token!r}, expected {best['token']!r} "
            f"(runner-up {second['token']!r}, log-probability gap {gap:.4f})"
        )
        return
    expected = [step["token"] for step in steps]
    assert got == (expected if whole else expected[: len(got)]), what
