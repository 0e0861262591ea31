"""A model's own chat template, read from its GGUF file or its `tokenizer_config.json` and
rendered the way transformers (and llama-cpp-python's server, 0.3.36) render one: a
sandboxed jinja2 environment with trimmed blocks and loop controls, `{% generation %}`
passed through, the model's BOS and EOS text, `raise_exception`, transformers' `tojson`
(`ensure_ascii`, `indent`, `separators`, `sort_keys`), `strftime_now`, and the request's
tools. The messages go to the template as the client sent them, as that engine gives
them. Whatever goes wrong in a template is a NoTemplate, with the template's reason.

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
from typing import Any, ClassVar

from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment


class NoTemplate(ValueError):
    """The file holds no chat template the addon can use, or it does not render this
    request; the message says why."""


class GenerationTags(Extension):
    """transformers' `{% generation %}...{% endgeneration %}`: its body, as it is."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Parser) -> list[nodes.Node]:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


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
            trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTags, loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise
        environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return environment.from_string(self.source)
        except TemplateError as exc:
            raise NoTemplate(f"its template does not compile: {exc}") from None

    def render(self, messages: list[Any], tools: Any = None, **kwargs: Any) -> str:
        """The prompt for `messages` (and `tools`, where offered), opening the
        assistant's turn; `kwargs` reach the template. Raises NoTemplate."""
        try:
            prompt = self._compiled.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **kwargs,
            )
        except NoTemplate:
            raise
        except Exception as exc:  # a template is code: anything it raises means "cannot"
            why = str(exc) if isinstance(exc, TemplateError) else f"{type(exc).__name__}: {exc}"
            raise NoTemplate(f"its template does not render this request: {why}") from None
        if self.text_route_adds_bos and self.bos_token:
            return prompt.removeprefix(self.bos_token)
        return prompt


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
        sort_keys=sort_keys,
    )  # fmt: skip


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
    try:
        from gguf import GGUFReader  # numpy behind it: an extra, for this path only
    except ImportError:
        raise NoTemplate(
            f"reading the template in {path} needs the gguf package: pip install "
            "'spillover[gguf]', or name the model's tokenizer_config.json instead"
        ) from None

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
