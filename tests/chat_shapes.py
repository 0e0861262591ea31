"""The conversation shapes real clients send, for the tests that run every real chat
template: a plain question, a system prompt, earlier turns, content parts, tools offered,
a tool-call history, and thinking turned off; and one answer as the model wrote it and as
the client received it (the primary's parser trimmed its leading space)."""

from __future__ import annotations

from typing import Any

from addon.formats.transcript import Transcript

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}]  # fmt: skip
QUESTION = {"role": "user", "content": "Tell me about the river."}
CALL = {
    "role": "assistant", "content": "",
    "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
}  # fmt: skip
SHAPES: dict[str, dict[str, Any]] = {
    "plain": {"messages": [QUESTION]},
    "system": {"messages": [{"role": "system", "content": "Be brief."}, QUESTION]},
    "multi-turn": {"messages": [
        QUESTION, {"role": "assistant", "content": "It runs north."},
        {"role": "user", "content": "And the bridge?"},
    ]},
    "content parts": {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Tell me"}, {"type": "text", "text": " about the river."},
    ]}]},
    "tools offered": {"messages": [QUESTION], "tools": TOOLS},
    "tool history": {"messages": [
        {"role": "user", "content": "Weather in Paris?"}, CALL,
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "Thanks. Tell me about the river."},
    ], "tools": TOOLS},
    "thinking off": {"messages": [QUESTION], "chat_template_kwargs": {"enable_thinking": False}},
}  # fmt: skip
RAW = " The river runs north, past the old mill"  # as the model wrote it
DELIVERED = RAW.lstrip()  # as the client received it (the parser trimmed the space)


def transcript(server: str, exact: bool) -> Transcript:
    """An answer cut after two chunks: with its tokens' bytes and the server's count
    (the raw output known) or as text alone."""
    record = Transcript()
    record.begin_leg(server)
    halves = [(DELIVERED[:10], RAW[:11]), (DELIVERED[10:], RAW[11:])]
    for made, (text, raw) in enumerate(halves, 1):
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}}
        chunk: dict[str, Any] = {"choices": [choice]}
        if exact:
            choice["logprobs"] = {"content": [{"id": 100 + made, "bytes": list(raw.encode())}]}
            chunk["timings"] = {"predicted_n": made}
        record.record(chunk)
    return record
