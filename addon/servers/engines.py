"""Which engine a server is, from what it answers to questions that change nothing, and
the engine's own route for counting tokens.

llama-server answers `/props` with its generation settings; in its router mode (several
models behind one server, each loaded when asked for) `/props` says `role: router`, and
the server refuses a `model` it does not serve. The other engines are told apart by who
`/v1/models` says owns their models (vLLM "vllm", SGLang "sglang", llama-cpp-python
"me", llama-server "llamacpp"). A server none of these fit is a plain OpenAI-compatible
one: nothing is assumed of it.
"""

from __future__ import annotations

from typing import Any

from addon.formats.shape import mapping

ROUTER = "llama-server router"
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
    """The engine behind the answers to `/props` and `/v1/models` (None: no answer)."""
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


def tokenize_request(engine: str, text: str) -> tuple[str, dict[str, Any]] | None:
    """The path and body that count `text`'s tokens on `engine`, where it has a route."""
    if engine not in TOKENIZE:
        return None
    path, field, extra = TOKENIZE[engine]
    return path, {field: text, **extra}


def token_count(answer: Any) -> int | None:
    tokens = mapping(answer).get("tokens")
    return len(tokens) if isinstance(tokens, list) else None
