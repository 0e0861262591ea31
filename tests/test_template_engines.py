"""The addon renders a chat prompt itself for one engine only: llama-cpp-python, whose chat
route opens a new turn after a partial message and which has no route that renders a
chat on asking (handoff/llama_cpp_python.py). So its rendering must be that engine's.
Here both render every template llama.cpp ships over the shapes real clients send: the
engine with its own code (`llama_cpp.llama_chat_format.Jinja2ChatFormatter`, run in the
virtual environment the setup built llama-cpp-python into), the addon with
formats/template.py. Each case is the same prompt, or the addon refuses it (a NoTemplate
with the template's reason, which ends such an answer in-band): 0 different, 0 crashes.
The counts are printed (and written in docs/engines.md).
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from typing import Any

import pytest

from addon.formats.rendering import parting_at
from addon.formats.template import ChatTemplate, NoTemplate
from scripts.testbed.llamacppfiles import templates
from scripts.testbed.llamacpppython import ensure_python
from tests.chat_shapes import SHAPES

BOS, EOS = "<s>", "</s>"
# Run by llama-cpp-python's own python: each case rendered by its chat formatter as its
# server's chat route does (messages and tools as the request has them, the generation
# prompt on), or the exception it raised.
ENGINE = """
import json, sys
from llama_cpp.llama_chat_format import Jinja2ChatFormatter
found, formatters = [], {}
for case in json.load(sys.stdin):
    key = (case["template"], case["bos"], case["eos"])
    try:
        if key not in formatters:
            formatters[key] = Jinja2ChatFormatter(template=case["template"], eos_token=case["eos"],
                                                  bos_token=case["bos"], add_generation_prompt=True)
        rendered = formatters[key](messages=case["messages"], tools=case["tools"])
        found.append({"prompt": rendered.prompt})
    except Exception as exc:
        found.append({"error": f"{type(exc).__name__}: {exc}"})
json.dump(found, sys.stdout)
"""


def engine_renderings(cases: list[dict[str, Any]]) -> list[dict[str, str]]:
    try:
        python = ensure_python()
    except Exception as exc:  # the setup could not build it here: say why
        pytest.skip(f"llama-cpp-python is not built here: {exc}")
    done = subprocess.run(
        [str(python), "-c", ENGINE], input=json.dumps(cases), capture_output=True, text=True,
        check=True, timeout=300,
    )  # fmt: skip
    return json.loads(done.stdout)


def test_the_addon_renders_every_real_template_as_llama_cpp_python_does(capsys) -> None:
    found = templates()
    assert len(found) >= 60, "llama.cpp's templates"
    cases = [
        {"name": f"{path.stem} / {shape}", "template": path.read_text(), "bos": BOS, "eos": EOS,
         "messages": SHAPES[shape]["messages"], "tools": SHAPES[shape].get("tools")}
        for path in found for shape in SHAPES
    ]  # fmt: skip
    tally: Counter[str] = Counter()
    different: list[str] = []
    ours_by_source = {path.read_text(): ChatTemplate(path.read_text(), BOS, EOS) for path in found}
    for case, engine in zip(cases, engine_renderings(cases), strict=True):
        try:
            ours = ours_by_source[case["template"]].render(
                json.loads(json.dumps(case["messages"])), tools=case["tools"]
            )
        except NoTemplate:
            tally["refused by the addon" + (" too" if "error" in engine else "")] += 1
            continue
        if "error" in engine:
            different.append(f"{case['name']}: the engine raised {engine['error']}")
        elif ours != engine["prompt"]:
            at = parting_at(ours, engine["prompt"])
            different.append(
                f"{case['name']}: at {at} the engine {engine['prompt'][at - 20 : at + 20]!r}, "
                f"the addon {ours[at - 20 : at + 20]!r}"
            )
        else:
            tally["the same prompt"] += 1
    with capsys.disabled():
        print("\ntemplates, the addon against llama-cpp-python:", json.dumps(dict(tally)))
    assert not different, "\n".join(different)
    assert tally["the same prompt"] >= len(cases) // 2


def test_the_comparison_finds_a_renderer_that_is_not_the_engines(monkeypatch) -> None:
    """The harness can fail: a renderer that drops the tools (as the addon's did before
    issue 41) differs from the engine on every template that prints them."""
    original = ChatTemplate.render
    monkeypatch.setattr(
        ChatTemplate, "render", lambda self, messages, tools=None, **kw: original(self, messages)
    )
    by_name = {path.stem: path for path in templates()}
    path = by_name["Qwen-Qwen2.5-7B-Instruct"]
    shape = SHAPES["tools offered"]
    case = {"template": path.read_text(), "bos": BOS, "eos": EOS,
            "messages": shape["messages"], "tools": shape["tools"]}  # fmt: skip
    (engine,) = engine_renderings([case])
    ours = ChatTemplate(case["template"], BOS, EOS).render(shape["messages"], tools=shape["tools"])
    assert "# Tools" in engine["prompt"] and ours != engine["prompt"]
