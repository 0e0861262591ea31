"""Token-exact replay: continue an answer from the very token ids already produced.

Replaying delivered text makes the next server tokenize it again, and a model's own
output is not always what its tokenizer would make of the same text, so the boundary
can drift. When the servers share a tokenizer (checked at start-up, see `servers/directory.py`),
the first leg asks its server for each token's id (logprobs, stripped again before the
client sees them unless it asked for logprobs itself), and a continuation goes to the
next server's native `/completion` as its rendered chat prompt followed by those ids.
Its native events are turned back into chat chunks here.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from addon.formats.continuation import CHAT_ONLY, ChunkRewriter, token_limit
from addon.formats.pieces import LOGPROBS_COUNTED, TIMINGS, TOKEN_IDS
from addon.formats.shape import constraint_of, positive_int
from addon.handoff import vllm
from addon.servers.upstream import Upstream

if TYPE_CHECKING:
    from addon.servers.directory import ServerDirectory


def eligible(path: str, body: dict[str, Any], tools: bool = False) -> bool:
    """A chat request whose answer the server renders from a template: no client
    prefill, no output constraint, and no tools unless `tools` (llama-server's pieces
    are asked for with tools too: they are the only way to know what its parser trimmed;
    its ids are then never replayed, see NextLeg._exact_ids)."""
    if not path.split("?")[0].endswith("/chat/completions") or body.get("stream") is not True:
        return False
    messages = body.get("messages")
    if not messages or not isinstance(messages[-1], dict):
        return False
    if messages[-1].get("role") == "assistant":
        return False
    return (tools or not body.get("tools")) and constraint_of(body) is None


def client_wants_logprobs(body: dict[str, Any]) -> bool:
    """Whether the client asked for token probabilities in any form the server takes:
    `logprobs` true (chat) or a count (text completions), or llama.cpp's `n_probs`."""
    logprobs = body.get("logprobs")
    return (
        logprobs is True
        or positive_int(logprobs) is not None
        or bool(positive_int(body.get("n_probs")))
    )


def may_ask_for_ids(body: dict[str, Any]) -> bool:
    """Whether the request may be changed to ask for token ids without changing what the
    server decides about it: the client set none of the probability fields, or only
    turned them off (`logprobs: false`, a boolean `post_sampling_probs`). Any other value
    is the client's, and the server's to accept or refuse."""
    if "top_logprobs" in body or "n_probs" in body or "timings_per_token" in body:
        return False
    if body.get("logprobs", False) is not False:
        return False
    return isinstance(body.get("post_sampling_probs", False), bool)


def asking_for_ids(body: dict[str, Any]) -> dict[str, Any]:
    """The request, also asking for the id and bytes of each token it streams (cheaply:
    only the sampled token's probability after sampling), and the server's count of the
    tokens it generated with each chunk (which shows the tokens it sent no piece for).
    Asked as llama.cpp's own `n_probs`, which its chat route passes through as it is:
    `logprobs` is refused there with tools in a stream, `n_probs` is not, and both put
    the same `logprobs` in each chunk."""
    return {**body, "n_probs": 1, "post_sampling_probs": True, "timings_per_token": True}


def first_leg_asks(
    path: str,
    body: dict[str, Any],
    raw_body: bytes,
    ladder: Sequence[Upstream],
    servers: ServerDirectory | None,
) -> tuple[bool, str | None, bytes]:
    """Whether the first leg asks for its tokens' pieces, which of them are taken out
    again before the client sees them (TOKEN_IDS, LOGPROBS_COUNTED or, where the client
    asked for logprobs itself, TIMINGS; None), and the first leg's request body. Asked in the
    first server's engine's own terms, wherever another server could continue: vLLM's
    ids (what it generated, marker tokens its parser hid included: replayed where a
    server shares its tokenizer, counted in the budget everywhere), llama-server's
    logprobs, since their bytes are what the model wrote before its parser trimmed or
    moved any of it (see Transcript.raw_output)."""
    if servers is None or len(ladder) < 2:
        return False, None, raw_body
    engine = servers.get(ladder[0]).engine
    if not eligible(path, body, tools=engine in ("llama-server", vllm.ENGINE)):
        return False, None, raw_body
    on_vllm = engine == vllm.ENGINE
    wants = vllm.client_wants_ids(body) if on_vllm else client_wants_logprobs(body)
    may_ask = vllm.may_ask_for_ids(body) if on_vllm else may_ask_for_ids(body)
    shared = any(servers.same_tokenizer(ladder[0], other) for other in ladder[1:])
    asks = (wants or may_ask) and (shared or engine in ("llama-server", vllm.ENGINE))
    if not asks or (wants and (on_vllm or "timings_per_token" in body)):
        return asks, None, raw_body
    if wants:
        # The client's logprobs stay; llama-server's count of its tokens is asked too
        # (and taken out), which shows the ids its chunks never carried (a held token's).
        return asks, TIMINGS, json.dumps({**body, "timings_per_token": True}).encode()
    asked = vllm.asking_for_ids(body) if on_vllm else asking_for_ids(body)
    return asks, TOKEN_IDS if on_vllm else LOGPROBS_COUNTED, json.dumps(asked).encode()


def native_body(
    body: dict[str, Any], prompt: list[str | int], produced: int, pieces: bool
) -> dict[str, Any]:
    """A native /completion request that goes on from `prompt` (the rendered chat
    prompt, as text or its ids, and the answer's token ids where they are replayed),
    with the chat request's sampling settings;
    asking for each token's piece where the client asked for logprobs or `pieces` (the
    answer's are being kept, and taken out again before the client sees them)."""
    native = {k: copy.deepcopy(v) for k, v in body.items() if k not in CHAT_ONLY}
    native["prompt"] = prompt
    native["stream"] = True
    if (limit := token_limit(body)) is not None:
        native["n_predict"] = max(1, limit - produced)
    if client_wants_logprobs(body):
        asked = positive_int(body.get("top_logprobs")) or positive_int(body.get("n_probs"))
        native["n_probs"] = asked or 1
        native["post_sampling_probs"] = bool(body.get("post_sampling_probs"))
    elif pieces:
        native["n_probs"] = 1
        native["post_sampling_probs"] = True
    return native


class NativeToChat:
    """Turns a native /completion stream's events into chat completion chunks (the
    pieces ride along as logprobs, which the splice strips unless the client asked)."""

    def __init__(self, model: str | None, include_usage: bool, replayed: int = 0) -> None:
        """`replayed`: the answer's token ids the prompt ends with (not the client's)."""
        self.model = model
        self.include_usage = include_usage
        self.replayed = replayed

    def chunk(self, event: dict[str, Any]) -> dict[str, Any]:
        probs = event.get("completion_probabilities") or []
        choice: dict[str, Any] = {"finish_reason": None, "index": 0, "delta": {}}
        if content := event.get("content"):
            choice["delta"]["content"] = content
        if probs:
            choice["logprobs"] = {"content": probs}
        chunk: dict[str, Any] = {
            "choices": [choice],
            "model": event.get("model") or self.model,
            "object": "chat.completion.chunk",
        }
        if event.get("stop") is True:
            choice["finish_reason"] = "length" if event.get("stop_type") == "limit" else "stop"
            if "timings" in event:
                chunk["timings"] = event["timings"]  # as llama-server's own last chat chunk
            if self.include_usage:
                completion = int(event.get("tokens_predicted") or 0)
                # The client's prompt: what the server read, less the answer replayed.
                prompt = max(0, int(event.get("tokens_evaluated") or 0) - self.replayed)
                chunk["usage"] = {
                    "completion_tokens": completion,
                    "prompt_tokens": prompt,
                    "total_tokens": completion + prompt,
                }
        return chunk


class NativeRewriter:
    """A native /completion leg's events as chunks of the client's chat stream;
    `on_reading` is given the first event's timings (asked with `timings_per_token`)."""

    def __init__(self, chat: NativeToChat, rewriter: ChunkRewriter) -> None:
        self._chat = chat
        self._rewriter = rewriter
        self.on_reading: Callable[[dict[str, Any]], None] | None = None

    def rewrite(self, event: dict[str, Any]) -> dict[str, Any] | None:
        if self.on_reading is not None and isinstance(timings := event.get("timings"), dict):
            self.on_reading(timings)
            self.on_reading = None
        return self._rewriter.rewrite(self._chat.chunk(event))
