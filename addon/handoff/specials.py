"""Text a model wrote that spells a special token of the next server (`<|im_end|>` or
`<think>` written as ordinary pieces): every engine here reads a prompt's text with its
special tokens parsed, on its chat route and its text route alike, so that text would
become the special token itself there. Asked of the server at the moment of use, each
engine its own way:

- llama-server (a router too, its model named): its ids of the text with and without
  special tokens parsed (`/tokenize`);
- vLLM: its tokenizer's added tokens (`/tokenizer_info`, served with
  `--enable-tokenizer-info-endpoint`) among its ids of the text (its `/tokenize` always
  parses them: it has no switch);
- llama-cpp-python: its ids of the text as its text route reads a prompt
  (`/extras/tokenize`) read back (`/extras/detokenize`, which writes no control token):
  a text that does not come back spells one.

A server that cannot be asked (another engine, vLLM without that route) does not get a
text that could spell one: a tag, a bracket or a bar, which every special token here is
written with.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from addon.servers.engines import RENDERS_ON_ASKING

Ask = Callable[[str, Any], Awaitable[Any]]  # a question to one server: path, body -> JSON
READ_BACK_LEAD = "x"
# What every special token of the vocabularies here is written with (<|im_end|>, </s>,
# [INST], >>TITLE<<, DeepSeek's full-width bars): a text without any of it spells none.
MAY_SPELL = re.compile("[<>\\[\\]|\uff5c]")


async def refusal(
    engine: str | None, ask: Ask, url: str, model: str | None, text: str
) -> str | None:
    """Why `text` cannot go as text to the server at `url` of `engine` (None: it can)."""
    if not text:
        return None
    try:
        if engine in RENDERS_ON_ASKING:
            return await spelled(ask, url, text, model)
        if engine == "vllm":
            return await _vllm_spelled(ask, url, text, model)
        if engine == "llama-cpp-python":
            return await _read_back(ask, url, text, model)
    except Exception as exc:  # whatever failed, it is not known: not sent
        return f"{url} could not say whether what the model wrote spells its special tokens: {exc}"
    return unaskable(url, text, f"a {engine or 'server'} cannot be asked")


async def spelled(ask: Ask, url: str, text: str, model: str | None = None) -> str | None:
    """Why `text` cannot go to the llama-server at `url` as text (None: it can); `model`:
    the model a router is asked about."""
    if not text:
        return None
    named = {"model": model} if model else {}
    try:
        parsed = await _pieces(ask, text, True, named)
        plain = await _pieces(ask, text, False, named)
    except Exception as exc:  # whatever failed, it is not known: not sent
        return f"{url} could not say whether what the model wrote spells its special tokens: {exc}"
    if [token for token, _ in parsed] == [token for token, _ in plain]:
        return None
    at = next(i for i, (a, b) in enumerate(zip(parsed, plain, strict=False)) if a != b)
    return _reads(url, parsed[at][1])


def unaskable(url: str, text: str, why: str) -> str | None:
    """Why `text` cannot go to a server that cannot be asked whether it spells one of its
    special tokens (`why` not); None where it could spell none."""
    if (found := MAY_SPELL.search(text)) is None:
        return None
    return (
        f"what the model wrote holds {found.group()!r}, which may spell a special token of "
        f"{url}, and {why} whether it does"
    )


async def _pieces(
    ask: Ask, text: str, special: bool, named: dict[str, str]
) -> list[tuple[int, str]]:
    body = {**named, "content": text, "parse_special": special, "with_pieces": True,
            "add_special": False}  # fmt: skip
    tokens = (await ask("/tokenize", body))["tokens"]
    return [(entry["id"], str(entry.get("piece"))) for entry in tokens]


async def _vllm_spelled(ask: Ask, url: str, text: str, model: str | None) -> str | None:
    try:
        info = await ask("/tokenizer_info", None)
    except Exception:  # not served (404 without --enable-tokenizer-info-endpoint)
        return unaskable(url, text, "its /tokenizer_info (--enable-tokenizer-info-endpoint) "
                         "is not served to ask")  # fmt: skip
    added = info["added_tokens_decoder"]
    named = {"model": model} if model else {}
    ids = (await ask("/tokenize", {**named, "prompt": text, "add_special_tokens": False}))["tokens"]
    found = next((added[str(token)] for token in ids if str(token) in added), None)
    return None if found is None else _reads(url, str(found))


async def _read_back(ask: Ask, url: str, text: str, model: str | None) -> str | None:
    # Led by a letter: where its tokenizer adds a BOS, its detokenize drops a space right
    # after it (llama-cpp-python's own rule), and the text may begin with one.
    led = READ_BACK_LEAD + text
    named = {"model": model} if model else {}
    ids = (await ask("/extras/tokenize", {**named, "input": led}))["tokens"]
    back = (await ask("/extras/detokenize", {**named, "tokens": ids}))["text"]
    if back == led:
        return None
    return (
        f"{url} reads what the model wrote, {text[-48:]!r}, back as "
        f"{back.removeprefix(READ_BACK_LEAD)[-48:]!r}: a "
        "special token it spells, or text it does not keep"
    )


def _reads(url: str, token: str) -> str:
    return (
        f"what the model wrote spells {token!r}, which {url} reads as its special "
        "token, not as the text the model wrote"
    )
