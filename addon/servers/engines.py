"""Which engine a server is, from what it answers to questions that change nothing, and
the engine's own route for counting tokens.

llama-server answers `/props` with its generation settings; in its router mode (several
models behind one server, each loaded when asked for) `/props` says `role: router`, and
the server refuses a `model` it does not serve. The other engines are told apart by who
`/v1/models` says owns their models (vLLM "vllm", SGLang "sglang", llama-cpp-python
"me", llama-server "llamacpp"). A server none of these fit is a plain OpenAI-compatible
one: nothing is assumed of it. The context length and token counts are each engine's
own, where it reports them.
"""

from __future__ import annotations

from typing import Any

from addon.formats.shape import mapping

LLAMA_SERVER = "llama-server"
ROUTER = "llama-server router"
# Engines that render a chat request on asking (`/apply-template`): what the model saw
# can be compared with a continuation's prompt there.
RENDERS_ON_ASKING = (LLAMA_SERVER, ROUTER)
OWNERS = {"llamacpp": "llama-server", "vllm": "vllm", "sglang": "sglang", "me": "llama-cpp-python"}
# Each engine's tokenize route: (path, the field that takes the text, the extra fields
# that keep special tokens out).
TOKENIZE = {
    "llama-server": ("/tokenize", "content", {}),
    ROUTER: ("/tokenize", "content", {}),
    "vllm": ("/tokenize", "prompt", {"add_special_tokens": False}),
    "sglang": ("/tokenize", "prompt", {"add_special_tokens": False}),
    "llama-cpp-python": ("/extras/tokenize", "input", {}),
}


def identify(props: Any, models: Any) -> str:
    """The engine behind the answers to `/props` and `/v1/models` ("openai-compatible"
    where they say no more, or nothing)."""
    if mapping(props).get("role") == "router":
        return ROUTER
    if isinstance(mapping(props).get("default_generation_settings"), dict):
        return "llama-server"
    data = mapping(models).get("data")
    owners = {mapping(entry).get("owned_by") for entry in data} if isinstance(data, list) else set()
    found = {OWNERS[owner] for owner in owners if isinstance(owner, str) and owner in OWNERS}
    return found.pop() if len(found) == 1 else "openai-compatible"


def model_ids(models: Any) -> list[str]:
    data = mapping(models).get("data")
    entries = data if isinstance(data, list) else []
    return [entry["id"] for entry in entries if isinstance(mapping(entry).get("id"), str)]


def context_length(models: Any) -> int | None:
    """The longest sequence `/v1/models` says the model takes (vLLM's `max_model_len`)."""
    data = mapping(models).get("data")
    first = mapping(data[0]) if isinstance(data, list) and data else {}
    length = first.get("max_model_len")
    return length if isinstance(length, int) and length > 0 else None


# The fields of a chat request that change how vLLM's `/tokenize` renders its messages.
CHAT_RENDERING = ("messages", "add_generation_prompt", "continue_final_message", "chat_template",
                  "chat_template_kwargs", "tools")  # fmt: skip


def chat_tokenize_request(engine: str, body: dict[str, Any]) -> tuple[str, dict] | None:
    """The path and body that count a chat request's prompt on `engine`, where its
    tokenize route renders messages itself (vLLM: the answer's `count`)."""
    if engine != "vllm" or not isinstance(body.get("messages"), list):
        return None
    request = {name: body[name] for name in CHAT_RENDERING if name in body}
    return "/tokenize", {"model": body.get("model"), **request} if body.get("model") else request


def tokenize_request(engine: str, text: str) -> tuple[str, dict[str, Any]] | None:
    """The path and body that count `text`'s tokens on `engine`, where it has a route."""
    if engine not in TOKENIZE:
        return None
    path, field, extra = TOKENIZE[engine]
    return path, {field: text, **extra}


def token_count(answer: Any) -> int | None:
    tokens = mapping(answer).get("tokens")
    return len(tokens) if isinstance(tokens, list) else None


def prompt_count(answer: Any) -> int | None:
    """A chat tokenize route's count of the prompt (vLLM's `count`, else its tokens)."""
    count = mapping(answer).get("count")
    return count if isinstance(count, int) else token_count(answer)
