"""How a later OpenAI chat or completion leg continues what the client has received.

`continuation_body` turns the original request into one that asks the next server to
go on from there (assistant prefill, fewer tokens left). `ChunkRewriter` makes that
server's chunks read as part of the same stream: the first leg's id and created, no
second role delta, the echoed prefill removed, usage for the whole answer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from addon.formats.dialect import EchoStrip, prefilled, unknown_echo, with_fewer_tokens
from addon.formats.pieces import thought_fields
from addon.formats.shape import constraint_of, positive_int, text_of
from addon.formats.transcript import Transcript

TOKEN_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict")

# Chat request fields that have no meaning for a text completion of a rendered prompt.
CHAT_ONLY = (
    "messages", "tools", "tool_choice", "parallel_tool_calls", "stream_options",
    "logprobs", "top_logprobs", "response_format", "chat_template_kwargs", "n",
    "reasoning_format", "add_generation_prompt", *TOKEN_LIMIT_FIELDS,
)  # fmt: skip


def continuation_body(original: dict[str, Any], transcript: Transcript) -> dict[str, Any]:
    """The original request, continued from what the client already has."""
    body = with_fewer_tokens(original, transcript.produced, TOKEN_LIMIT_FIELDS)
    delivered, reasoning = transcript.text, transcript.reasoning_text
    if not delivered and not reasoning:
        return body  # nothing went out: the request as the client sent it, echo and all
    # The client has had its echo (of the prompt, or of its own prefill), at the start of
    # what was delivered: a later leg echoes nothing, and goes on from the answer alone.
    echoed = body.pop("echo", None) is True
    if isinstance(body.get("prompt"), str):
        if echoed:
            delivered = delivered.removeprefix(body["prompt"])
        body["prompt"] += delivered  # a text completion simply goes on from its prompt
    else:
        messages = list(body.get("messages") or [])
        messages = prefilled(messages, delivered, transcript.prefill_echoed, _assistant)
        if reasoning:
            # llama-server goes on with the reasoning while the answer has no content yet,
            # else it renders the reasoning closed and goes on with the content.
            messages[-1]["reasoning_content"] = reasoning
        body["messages"] = messages
    return body


def _assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def token_limit(body: dict[str, Any]) -> int | None:
    """How many tokens the request may still produce, when it says."""
    for name in TOKEN_LIMIT_FIELDS:
        if (limit := positive_int(body.get(name))) is not None:
            return limit
    return None


def cannot_continue(body: dict[str, Any], transcript: Transcript) -> str | None:
    """Why another server cannot honestly continue this answer, or None when it can.
    Before any text went out, any server can simply answer from the start."""
    if transcript.other_parts:
        parts = " and ".join(sorted(transcript.other_parts))
        return f"the answer so far has {parts}, which cannot be continued elsewhere"
    if not transcript.content:
        return None
    if (why := bound_by(body)) is not None:
        return why
    if _prefill_message(body) is not None and prefill_of(body) is None:
        return "the client's assistant prefill is not plain text"
    return unknown_echo(transcript)


def bound_by(body: dict[str, Any]) -> str | None:
    """Why an answer with text sent cannot go on elsewhere for its constraint, in any API:
    the next server would start the grammar over, mid-answer."""
    if (constraint := constraint_of(body)) is not None:
        return f"the answer is bound by {constraint}, which another server would start over"
    return None


def _prefill_message(body: dict[str, Any]) -> dict[str, Any] | None:
    messages = body.get("messages")
    if isinstance(messages, list) and messages and messages[-1].get("role") == "assistant":
        return messages[-1]
    return None


def prefill_of(body: dict[str, Any]) -> str | None:
    """The text of the client's own assistant prefill ("" without one; None when it is
    not plain text)."""
    message = _prefill_message(body)
    return "" if message is None else text_of(message.get("content"))


class ChunkRewriter:
    """Rewrites one continuation leg's chunks to fit the stream the client is reading.

    `echo` says whether the server repeats the prefill at the start of its answer:
    True or False when known (probed), None to decide from the first content delta.
    Reasoning is echoed like content; once the answer has moved on to content, the
    server restates the finished reasoning, which is dropped whole.
    """

    def __init__(self, transcript: Transcript, prefill: str, echo: bool | None) -> None:
        self._transcript = transcript
        self._echo = {"content": EchoStrip(prefill, echo)}
        self._thought = EchoStrip(transcript.reasoning_text, echo)
        self._reasoning_done = bool(transcript.reasoning and transcript.content)
        # Reasoning goes on in the fields the client has been reading it in (llama-server
        # and vLLM name it differently; some vLLM builds write both).
        self._fields = transcript.reasoning_fields

    def rewrite(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """The chunk as the client should see it, or None when nothing is left of it."""
        transcript = self._transcript
        if transcript.id is not None:
            chunk["id"] = transcript.id
            chunk["created"] = transcript.created
        choices = chunk.get("choices")
        if not choices:
            if chunk.get("usage"):
                chunk["usage"] = self._whole_answer_usage(chunk["usage"])
            return chunk
        keep = False
        for choice in choices:
            delta = choice.get("delta") or {}
            if delta.get("role") and transcript.role_sent:
                del delta["role"]
                if delta.get("content") is None:
                    delta.pop("content", None)
            thought = self._thought_of(delta)
            if thought and not self._reasoning_done and (thought := self._thought(thought)):
                delta.update(dict.fromkeys(self._fields or ("reasoning_content",), thought))
            if delta.get("content"):
                delta["content"] = self._echo["content"](delta["content"])
                if not delta["content"]:
                    del delta["content"]
            if delta or choice.get("text") or choice.get("finish_reason") is not None:
                keep = True
            elif choice.get("token_ids"):
                keep = True  # ids whose text is held or hidden (vLLM's): the count needs them
        if chunk.get("usage"):
            chunk["usage"] = self._whole_answer_usage(chunk["usage"])
            keep = True
        return chunk if keep else None

    def _thought_of(self, delta: dict[str, Any]) -> str | None:
        """The delta's reasoning, taken out of every field its server wrote it in."""
        fields = thought_fields(delta)
        if not fields:
            return None
        self._fields = self._fields or fields
        thoughts = [delta.pop(field) for field in fields]
        return thoughts[0]

    def _whole_answer_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """Usage for the whole answer: every leg's completion tokens, and the prompt the
        last leg read (the original prompt plus the replayed answer), leg by leg too."""
        legs = self._transcript.legs
        legs[-1].prompt_tokens = usage.get("prompt_tokens")
        completion = self._transcript.whole_answer_tokens(usage.get("completion_tokens"))
        prompt = int(usage.get("prompt_tokens") or 0)
        return {
            **usage,
            "completion_tokens": completion,
            "prompt_tokens": prompt,
            "total_tokens": completion + prompt,
            "spillover": {"legs": [dataclasses.asdict(leg) for leg in legs]},
        }
