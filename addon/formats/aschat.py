"""A Messages or Responses request as the chat request llama-server makes of it.

llama-server serves `/v1/messages` and `/v1/responses` by translating the request into
a chat request and handling that as its chat route does
(`server_chat_convert_anthropic_to_oai` and `server_chat_convert_responses_to_chatcmpl`
in llama.cpp's tools/server/server-chat.cpp): the model sees that chat request's
rendering. The same translation here, of what reaches the template (messages, tools,
tool choice, kwargs, reasoning effort), lets `/apply-template` show what those routes
render; handoff/translated.py checks it against the server's own token count of the
request before anything relies on it. A request llama-server would refuse is refused
here too (NotTranslated).
"""

from __future__ import annotations

import json
from typing import Any

BILLING = "x-anthropic-billing-header:"
CCH = 5  # the characters of the billing header's `cch=` stamp, which llama-server blanks


class NotTranslated(ValueError):
    """The request is not one llama-server's route translates; the message says why."""


def messages_as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request llama-server's `/v1/messages` makes of an Anthropic `body`."""
    messages: list[dict[str, Any]] = []
    if "system" in body and body["system"] is not None:
        messages.append({"role": "system", "content": _system(body["system"])})
    if not isinstance(body.get("messages"), list):
        raise NotTranslated("'messages' is required")
    for message in body["messages"]:
        messages.extend(_anthropic_message(message))
    chat: dict[str, Any] = {"messages": messages}
    if isinstance(tools := body.get("tools"), list):
        chat["tools"] = [_anthropic_tool(tool) for tool in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") in ("auto", "any", "tool"):
        chat["tool_choice"] = "auto" if choice["type"] == "auto" else "required"
    if "chat_template_kwargs" in body:
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    return chat


def _system(system: Any) -> str:
    if isinstance(system, str):
        return _billing_blanked(system)
    if isinstance(system, list):
        return "".join(
            _billing_blanked(str(block.get("text", "")))
            for block in system
            if isinstance(block, dict) and block.get("type") == "text"
        )
    return ""


def _billing_blanked(text: str) -> str:
    """llama-server's `normalize_anthropic_billing_header`: the stamp after `cch=` of a
    Claude Code billing header read as f's (it changes with every request)."""
    if not text.startswith(BILLING) or (at := text.find("cch=", len(BILLING))) < 0:
        return text
    start = at + 4
    if start + CCH < len(text) and text[start + CCH] == ";":
        return text[:start] + "f" * CCH + text[start + CCH :]
    return text


def _anthropic_message(message: dict[str, Any]) -> list[dict[str, Any]]:
    role, content = message.get("role", ""), message.get("content")
    if "content" not in message:
        return [] if role == "assistant" else [message]
    if not isinstance(content, list):
        return [message]
    parts: list[Any] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    reasoning = ""
    for block in content:
        kind = block.get("type", "") if isinstance(block, dict) else ""
        if kind == "text":
            parts.append(block)
        elif kind == "thinking":
            reasoning += str(block.get("thinking", ""))
        elif kind == "tool_use":
            calls.append(_tool_use(block))
        elif kind == "tool_result":
            results.append(_tool_result(block))
        elif kind == "image":
            raise NotTranslated("an image block (its rendering is not checked here)")
    out: list[dict[str, Any]] = []
    if parts or calls or reasoning:
        new: dict[str, Any] = {"role": role, "content": parts or ""}
        if calls:
            new["tool_calls"] = calls
        if reasoning:
            new["reasoning_content"] = reasoning
        out.append(new)
    return [*out, *results]


def _tool_use(block: dict[str, Any]) -> dict[str, Any]:
    """A tool_use block as a chat tool call, its input written as nlohmann's `dump()`
    writes it (keys sorted, no spaces)."""
    arguments = json.dumps(
        block.get("input", {}), separators=(",", ":"), sort_keys=True, ensure_ascii=False
    )
    function = {"name": block.get("name", ""), "arguments": arguments}
    return {"id": block.get("id", ""), "type": "function", "function": function}


def _tool_result(block: dict[str, Any]) -> dict[str, Any]:
    result = block.get("content")
    if isinstance(result, list):
        if any(isinstance(c, dict) and c.get("type") == "image" for c in result):
            raise NotTranslated("an image in a tool result (its rendering is not checked here)")
        texts = [c for c in result if isinstance(c, dict) and c.get("type") == "text"]
        result = "".join(str(c.get("text", "")) for c in texts)
    elif not isinstance(result, str):
        result = ""
    return {"role": "tool", "tool_call_id": block.get("tool_use_id", ""), "content": result}


def _anthropic_tool(tool: Any) -> dict[str, Any]:
    tool = tool if isinstance(tool, dict) else {}
    function = {"name": tool.get("name", ""), "description": tool.get("description", ""),
                "parameters": tool.get("input_schema", {})}  # fmt: skip
    return {"type": "function", "function": function}


def responses_as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request llama-server's `/v1/responses` makes of a Responses `body`: the
    body as it is (every other field goes through), `input` and `instructions` made
    messages, function tools made chat tools, `reasoning.effort` its `reasoning_effort`."""
    if body.get("previous_response_id"):
        raise NotTranslated("llama.cpp does not support 'previous_response_id'")
    chat = {k: v for k, v in body.items() if k not in ("input", "instructions", "tools")}
    messages: list[dict[str, Any]] = []
    if "instructions" in body:
        instructions = body["instructions"]
        content = instructions if isinstance(instructions, str) else ""
        messages.append({"role": "system", "content": content})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            _response_item(messages, dict(item) if isinstance(item, dict) else {})
    else:
        raise NotTranslated("'input' must be a string or array of objects")
    chat["messages"] = messages
    if isinstance(tools := body.get("tools"), list):
        functions = [_response_tool(t) for t in tools if isinstance(t, dict)]
        if functions := [f for f in functions if f is not None]:
            chat["tools"] = functions
    reasoning = chat.pop("reasoning", None)
    if isinstance(reasoning, dict) and "effort" in reasoning:
        chat["reasoning_effort"] = reasoning["effort"]
    return chat


CALL_FIELDS = ("arguments", "call_id", "name")


def _response_item(messages: list[dict[str, Any]], item: dict[str, Any]) -> None:
    """`messages` with one input item added, as llama-server adds it."""
    after_assistant = bool(messages) and messages[-1].get("role") == "assistant"
    if isinstance(item.get("content"), str):
        item["content"] = [{"text": item["content"], "type": "input_text"}]
    role, kind = item.get("role"), item.get("type")
    if isinstance(item.get("content"), list) and role in ("user", "system", "developer"):
        item.pop("type", None)
        item.pop("status", None)
        messages.append({**item, "content": [_input_part(p) for p in item["content"]]})
    elif role == "assistant" and kind == "message":
        parts = [_output_part(p) for p in item.get("content") or []]
        if after_assistant:
            last = messages[-1]
            last["content"] = [*(last.get("content") or []), *parts]
        else:
            rest = {k: v for k, v in item.items() if k not in ("status", "type")}
            messages.append({**rest, "content": parts})
    elif kind == "reasoning" and isinstance(item.get("summary"), list):
        content = item.get("content")
        if not isinstance(content, list) or not content:
            raise NotTranslated("a reasoning item without content")
        text = content[0].get("text") if isinstance(content[0], dict) else None
        if not isinstance(text, str):
            raise NotTranslated("a reasoning item's content is not text")
        if after_assistant:
            messages[-1]["reasoning_content"] = text
        else:
            messages.append({"role": "assistant", "content": [], "reasoning_content": text})
    elif kind == "function_call" and all(isinstance(item.get(k), str) for k in CALL_FIELDS):
        call = {"function": {"arguments": item["arguments"], "name": item["name"]},
                "id": item["call_id"], "type": "function"}  # fmt: skip
        if after_assistant:
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif kind == "function_call_output" and isinstance(item.get("output"), str):
        output = {"content": item["output"], "role": "tool", "tool_call_id": item.get("call_id")}
        messages.append(output)
    else:
        raise NotTranslated(f"an input item of type {kind!r} (its rendering is not checked here)")


def _input_part(part: Any) -> dict[str, Any]:
    if isinstance(part, dict) and part.get("type") == "input_text" and "text" in part:
        return {"text": part["text"], "type": "text"}
    raise NotTranslated("an input part other than text (its rendering is not checked here)")


def _output_part(part: Any) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("output_text", "input_text") and isinstance(part.get("text"), str):
        return {"text": part["text"], "type": "text"}
    raise NotTranslated("an output part other than text (its rendering is not checked here)")


def _response_tool(tool: dict[str, Any]) -> dict[str, Any] | None:
    if tool.get("type") != "function":
        return None  # llama-server skips tools other than functions
    function = {k: v for k, v in tool.items() if k != "type"}
    function.setdefault("strict", True)
    return {"type": "function", "function": function}


AS_CHAT = {"messages": messages_as_chat, "responses": responses_as_chat}
