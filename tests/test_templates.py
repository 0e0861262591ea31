"""A model's chat template, read from its GGUF or its tokenizer_config.json and rendered as
transformers renders one (the real servers' reading of it is checked in test_engines.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from addon.formats.template import NoTemplate, read_template
from scripts.testbed.prompts import PROMPT
from scripts.testbed.tinymodels import CHATML_TEMPLATE


def test_a_ggufs_template_and_special_tokens_are_read(models: dict[str, Path]) -> None:
    template = read_template(models["fallback"])
    assert template.source == CHATML_TEMPLATE and template.origin == str(models["fallback"])
    assert template.bos_token == "<s>"
    assert template.render(PROMPT) == (
        f"<|im_start|>user\n{PROMPT[0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_tokenizer_config_gives_its_default_template_and_token_texts(tmp_path: Path) -> None:
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({
        "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": (
                "{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}"
                "{% if loop.last %}{% break %}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}>{% endif %}"
            )},
        ],
        "bos_token": {"content": "<|begin|>", "lstrip": False},
        "eos_token": "<|end|>",
    }))  # fmt: skip
    template = read_template(config)
    assert (template.bos_token, template.eos_token) == ("<|begin|>", "<|end|>")
    assert template.render([{"role": "user", "content": "é"}]) == '<|begin|>"é">'


def test_what_cannot_be_used_says_why(tmp_path: Path) -> None:
    with pytest.raises(NoTemplate, match="cannot read"):
        read_template(tmp_path / "missing.json")
    (tmp_path / "none.json").write_text("{}")
    with pytest.raises(NoTemplate, match="has no chat_template"):
        read_template(tmp_path / "none.json")
    raising = tmp_path / "raising.json"
    raising.write_text(json.dumps({"chat_template": "{{ raise_exception('no system role') }}"}))
    with pytest.raises(NoTemplate, match="does not render this request: no system role"):
        read_template(raising).render(PROMPT)
