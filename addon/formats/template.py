"""A model's own chat template, read from its GGUF file or its `tokenizer_config.json` and
rendered the way transformers (and llama-cpp-python's server) render one: a sandboxed
jinja2 environment with trimmed blocks, the model's BOS and EOS text, `raise_exception`,
`tojson` and `strftime_now`.

A server whose chat route cannot continue a partial answer (llama-cpp-python's server
opens a new turn after one) still continues a text completion of its own chat prompt,
rendered here, followed by the answer so far (handoff/rendered.py).

Engines read a rendering differently on their two routes. llama-cpp-python's chat route
tokenizes the rendering as it is (the template writes BOS or not), its text route adds
the tokenizer's BOS in front of any prompt; vLLM's routes differ the same way by default.
So a template that writes `bos_token` itself reads on a text route as two BOS tokens:
`text_route_adds_bos` leaves the template's out there (which of them holds is proven per
server, servers/proof.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class NoTemplate(ValueError):
    """The file holds no chat template the addon can use; the message says why."""


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""
    origin: str = ""  # where it was read, for status
    text_route_adds_bos: bool = False  # a leading bos_token is left to the tokenizer

    @cached_property
    def _compiled(self):
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise
        environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return environment.from_string(self.source)

    def render(self, messages: list[Any], **kwargs: Any) -> str:
        """The prompt for `messages`, opening the assistant's turn; `kwargs` reach the
        template (a request's `chat_template_kwargs`). Raises NoTemplate."""
        try:
            prompt = self._compiled.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **kwargs,
            )
        except TemplateError as exc:
            raise NoTemplate(f"its template does not render: {exc}") from None
        if self.text_route_adds_bos and self.bos_token:
            return prompt.removeprefix(self.bos_token)
        return prompt


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise(message: str) -> None:
    raise TemplateError(message)


def read_template(path: Path) -> ChatTemplate:
    """The chat template in a GGUF file or a `tokenizer_config.json`. Raises NoTemplate."""
    if path.suffix == ".gguf":
        return _from_gguf(path)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise NoTemplate(f"cannot read {path}: {exc}") from None
    source = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str):
        raise NoTemplate(f"{path} has no chat_template")
    return ChatTemplate(source, _token(config.get("bos_token")), _token(config.get("eos_token")),
                        str(path))  # fmt: skip


def _token(value: Any) -> str:
    """A special token as tokenizer_config.json writes it (text, or an object with one)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _from_gguf(path: Path) -> ChatTemplate:
    from gguf import GGUFReader  # numpy behind it: only where a GGUF is read

    try:
        fields = GGUFReader(path).fields
    except (OSError, ValueError) as exc:
        raise NoTemplate(f"cannot read {path}: {exc}") from None
    if "tokenizer.chat_template" not in fields:
        raise NoTemplate(f"{path} has no tokenizer.chat_template")
    tokens = fields.get("tokenizer.ggml.tokens")

    def special(name: str) -> str:
        field = fields.get(f"tokenizer.ggml.{name}_token_id")
        if field is None or tokens is None:
            return ""
        index = int(field.contents())
        return bytes(tokens.parts[tokens.data[index]]).decode(errors="replace")

    source = str(fields["tokenizer.chat_template"].contents())
    return ChatTemplate(source, special("bos"), special("eos"), str(path))
